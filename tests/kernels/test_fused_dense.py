"""Fused dense layers (csrc/fused_dense over cuBLASLt) vs the plain F.linear/GELU composition.

CPU: the fallback path equals the composition, forward and backward, and bad shapes raise.
GPU: the extension and the composition, each against a float64 reference, forward and backward.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from tpflash.kernels import fused_dense, fused_dense_gelu_dense, use_backend
from tpflash.kernels.fused_dense import (build_options_module, dense_gelu_dense_reference, extension_status,
                                         load_extension)

# ||actual - fp64|| / ||fp64|| allowed for outputs and gradients of one or two bf16/fp16 GEMMs.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5, torch.float64: 1e-12}


def _rel_err(actual, expected) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def _mlp_inputs(shape, hidden, out, dtype, device, bias=True):
    torch.manual_seed(0)
    k = shape[-1]
    x = torch.randn(shape, device=device, dtype=dtype)
    w1 = (torch.randn(hidden, k, device=device) / k ** 0.5).to(dtype)
    b1 = (0.5 * torch.randn(hidden, device=device)).to(dtype) if bias else None
    w2 = (torch.randn(out, hidden, device=device) / hidden ** 0.5).to(dtype)
    b2 = (0.5 * torch.randn(out, device=device)).to(dtype) if bias else None
    return [x, w1, b1, w2, b2]


def _outputs_and_grads(fn, inputs, d_out, dtype=None):
    """fn(*inputs) and the gradients of every tensor input, optionally on copies cast to `dtype`."""
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], d_out.to(out.dtype))
    return out, grads


def _autograd_nodes(out) -> set:
    names, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    return names


def _check_against_fp64(fn, inputs, names, tol, backend, fused_node=None):
    """fn on `inputs` (run under `backend`) vs the fp64 composition: outputs and every gradient.
    fused_node: the autograd node the output must (str) or must not (False) come through."""
    torch.manual_seed(1)
    d_out = torch.randn_like(fn(*inputs).detach().float())
    with use_backend(backend):
        out, grads = _outputs_and_grads(fn, inputs, d_out)
    nodes = _autograd_nodes(out)
    if fused_node:
        assert fused_node in nodes, f"the extension path did not run: autograd nodes {nodes}"
    elif fused_node is False:
        assert not any(n.startswith("FusedDense") for n in nodes), f"the extension ran: {nodes}"
    with use_backend("reference"):
        ref_out, ref_grads = _outputs_and_grads(fn, inputs, d_out.double(), torch.float64)
    errors = {"out": _rel_err(out, ref_out)}
    errors.update({n: _rel_err(g, r) for n, g, r in zip(names, grads, ref_grads)})
    assert out.dtype == inputs[0].dtype
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors over {tol}: {bad} (all: {errors})"
    return errors


# ----------------------------------------------------------------------------- CPU: fallback path
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_dense_gelu_dense_fallback_matches_composition(bias):
    x, w1, b1, w2, b2 = _mlp_inputs((2, 5, 12), 24, 10, torch.float32, "cpu", bias)
    d_out = torch.randn(2, 5, 10)
    inputs = [x, w1, b1, w2, b2]
    out, grads = _outputs_and_grads(fused_dense_gelu_dense, inputs, d_out)
    h = F.gelu(F.linear(x, w1, b1), approximate="tanh")  # written out, not via the module's reference
    ref_out, ref_grads = _outputs_and_grads(lambda *t: F.linear(F.gelu(F.linear(t[0], t[1], t[2]),
                                                                       approximate="tanh"), t[3], t[4]),
                                            inputs, d_out)
    assert torch.allclose(out, F.linear(h, w2, b2), atol=1e-6)
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_dense_fallback_matches_linear(bias):
    x, w, b = _mlp_inputs((3, 4, 16), 8, 8, torch.float32, "cpu", bias)[:3]
    d_out = torch.randn(3, 4, 8)
    inputs = [x, w, b]
    out, grads = _outputs_and_grads(fused_dense, inputs, d_out)
    ref_out, ref_grads = _outputs_and_grads(F.linear, inputs, d_out)
    torch.testing.assert_close(out, ref_out)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_fallback_gelu_is_the_tanh_approximation():
    x, w1, b1, w2, b2 = _mlp_inputs((4, 8), 16, 8, torch.float64, "cpu")
    h = F.linear(x, w1, b1)
    tanh_gelu = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h ** 3)))
    torch.testing.assert_close(dense_gelu_dense_reference(x, w1, b1, w2, b2), F.linear(tanh_gelu, w2, b2))


def test_fused_dense_gelu_dense_rejects_mismatched_weights():
    x, w1, b1, w2, b2 = _mlp_inputs((4, 8), 16, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"w2.shape\[1\]=12 must equal its input's last dim 16"):
        fused_dense_gelu_dense(x, w1, b1, torch.randn(8, 12), b2)
    with pytest.raises(ValueError, match=r"bias of w1 has shape \(3,\), must be \[16\]"):
        fused_dense_gelu_dense(x, w1, torch.randn(3), w2, b2)


def test_fused_dense_rejects_an_input_of_the_wrong_width():
    with pytest.raises(ValueError, match=r"weight.shape\[1\]=8 must equal its input's last dim 6"):
        fused_dense(torch.randn(2, 6), torch.randn(4, 8))


def test_extension_is_not_loaded_without_cuda_or_jit_request():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may have the extension")
    assert load_extension() is None
    assert "tpflash_fused_dense" in extension_status()


def _fake_cuda_home(root, with_cublas: bool):
    (root / "include").mkdir(parents=True)
    (root / "lib64").mkdir()
    if with_cublas:
        for name in ("include/cublasLt.h", "include/cublas_api.h", "lib64/libcublasLt.so"):
            (root / name).write_text("")
    return root


def test_jit_build_passes_sources_flags_and_cublaslt_to_cpp_extension_load(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp

    from tpflash.kernels.fused_dense import _jit_build
    cuda_home = _fake_cuda_home(tmp_path / "cuda", with_cublas=True)
    calls = []
    monkeypatch.setattr(cpp, "CUDA_HOME", str(cuda_home))
    monkeypatch.setattr(cpp, "load", lambda **kw: calls.append(kw) or "module")
    assert _jit_build() == "module"
    (kw,) = calls
    assert kw["name"] == "tpflash_fused_dense"
    assert [s.rsplit("/", 1)[-1] for s in kw["sources"]] == ["fused_dense.cpp", "fused_dense_cuda.cu"]
    assert "-gencode=arch=compute_90,code=sm_90" in kw["extra_cuda_cflags"]
    assert kw["extra_ldflags"] == [str(cuda_home / "lib64" / "libcublasLt.so")]
    assert kw["extra_include_paths"] == []  # the toolkit's include dir is on nvcc's path already


def test_build_options_links_wheel_cublas_headers_into_a_private_folder(tmp_path, monkeypatch):
    import sys

    build = build_options_module()
    wheel = tmp_path / "site" / "nvidia" / "cu13"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    for name in ("include/cublasLt.h", "include/cublas_api.h", "include/cuda_runtime.h", "lib/libcublasLt.so.13"):
        (wheel / name).write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")] + sys.path)
    opts = build.build_options(str(_fake_cuda_home(tmp_path / "cuda", with_cublas=False)), tmp_path / "inc")
    assert opts.include_dirs == [str(tmp_path / "inc")]
    assert sorted(p.name for p in (tmp_path / "inc").iterdir()) == ["cublasLt.h", "cublas_api.h"]
    assert opts.ldflags == [str(wheel / "lib" / "libcublasLt.so.13")]


def test_build_options_name_what_is_missing(tmp_path):
    build = build_options_module()
    cuda_home = _fake_cuda_home(tmp_path / "cuda", with_cublas=False)
    if build.find_cublaslt_header(str(cuda_home)) is not None:
        pytest.skip("this machine has cuBLAS headers in its Python packages")
    with pytest.raises(FileNotFoundError, match="cublasLt.h"):
        build.build_options(str(cuda_home), tmp_path / "inc")


# ----------------------------------------------------------------------------- GPU: extension vs composition
HALF = [torch.bfloat16, torch.float16]
PATHS = ["extension", "reference"]


def _need_extension(path):
    """The extension is optional and off by default (docs/csrc.md): where it was not built, its tests
    skip, naming how to build it; where a build was asked for (TPFLASH_JIT_CUDA=1, as
    benchmarks/fused_dense_check.sh does) and did not load, they fail with the compiler's output."""
    if path != "extension" or load_extension() is not None:
        return
    if os.environ.get("TPFLASH_JIT_CUDA") == "1":
        pytest.fail(f"the fused-dense extension is not loaded: {extension_status()}")
    pytest.skip(f"the optional fused-dense extension is not built ({extension_status()}); "
                "benchmarks/fused_dense_check.sh builds it")


@pytest.mark.gpu
def test_extension_loads_on_gpu_when_built_or_asked_for():
    _need_extension("extension")
    assert load_extension() is not None, extension_status()


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_dense_gelu_dense_matches_fp64_on_gpu(path, dtype, bias):
    _need_extension(path)
    inputs = _mlp_inputs((3, 97, 256), 1024, 192, dtype, "cuda", bias)  # 291 rows: not a multiple of 8
    _check_against_fp64(fused_dense_gelu_dense, inputs, ["dx", "dw1", "db1", "dw2", "db2"], TOL[dtype],
                        "auto" if path == "extension" else "reference",
                        "FusedDenseGeluDenseBackward" if path == "extension" else False)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_fused_dense_matches_fp64_on_gpu(path, dtype, bias):
    _need_extension(path)
    inputs = _mlp_inputs((4, 75, 320), 512, 8, dtype, "cuda", bias)[:3]
    _check_against_fp64(fused_dense, inputs, ["dx", "dw", "db"], TOL[dtype],
                        "auto" if path == "extension" else "reference",
                        "FusedDenseBackward" if path == "extension" else False)


@pytest.mark.gpu
def test_extension_error_is_no_worse_than_composition_on_gpu():
    _need_extension("extension")
    inputs = _mlp_inputs((8, 128, 512), 2048, 512, torch.bfloat16, "cuda")
    names = ["dx", "dw1", "db1", "dw2", "db2"]
    ext = _check_against_fp64(fused_dense_gelu_dense, inputs, names, TOL[torch.bfloat16], "auto",
                              "FusedDenseGeluDenseBackward")
    ref = _check_against_fp64(fused_dense_gelu_dense, inputs, names, TOL[torch.bfloat16], "reference")
    worse = {n: (ext[n], ref[n]) for n in ext if ext[n] > 1.5 * ref[n] + 1e-3}
    assert not worse, f"extension vs composition relative errors (ext, composition): {worse}"


@pytest.mark.gpu
def test_fused_dense_gelu_dense_under_autocast_gives_fp32_grads_on_gpu():
    _need_extension("extension")
    x, w1, b1, w2, b2 = [t.requires_grad_() for t in _mlp_inputs((64, 128), 256, 128, torch.float32, "cuda")]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fused_dense_gelu_dense(x, w1, b1, w2, b2)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in (x, w1, b1, w2, b2))
    with torch.no_grad():
        ref = dense_gelu_dense_reference(x.double(), w1.double(), b1.double(), w2.double(), b2.double())
    assert _rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_unaligned_widths_fall_back_to_composition_on_gpu():
    inputs = _mlp_inputs((2, 33, 36), 100, 20, torch.bfloat16, "cuda")  # widths not multiples of 8
    _check_against_fp64(fused_dense_gelu_dense, inputs, ["dx", "dw1", "db1", "dw2", "db2"],
                        TOL[torch.bfloat16], "auto", fused_node=False)


@pytest.mark.gpu
def test_parallel_mlp_with_fused_dense_matches_unfused_mlp_on_gpu():
    # tp=1 (no group): the layer's fused path goes through the extension and agrees with its unfused path
    _need_extension("extension")
    from tpflash.layers import ParallelMLP
    torch.manual_seed(0)
    unfused = ParallelMLP(256, 1024, mlp="gelu", device="cuda")
    fused = ParallelMLP(256, 1024, mlp="gelu", fused_dense=True, device="cuda")
    fused.load_state_dict(unfused.state_dict())
    x = torch.randn(64, 2, 256, device="cuda")
    results = []
    for layer in (unfused, fused):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        results.append([out] + [p.grad for p in layer.parameters()])
    assert "FusedDenseGeluDenseBackward" in _autograd_nodes(out)
    for a, b in zip(*results):
        assert _rel_err(b, a) <= TOL[torch.bfloat16]
