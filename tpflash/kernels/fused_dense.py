"""Fused dense layers over cuBLASLt epilogues (the csrc/fused_dense extension), with a PyTorch fallback.

    fused_dense(x, w, b)                     == F.linear(x, w, b)
    fused_dense_gelu_dense(x, w1, b1, w2, b2) == F.linear(gelu_tanh(F.linear(x, w1, b1)), w2, b2)

With the extension loaded and eligible inputs (CUDA; float16/bfloat16, or autocast to one; every
feature dim a multiple of 8; 16-byte aligned) the MLP runs as
    forward:  pre = x w1^T + b1, h = gelu(pre)   one cuBLASLt GEMM (GELU_AUX_BIAS epilogue, keeps pre)
              y = h w2^T + b2                    addmm (PyTorch's cuBLASLt bias epilogue)
    backward: dw2, db2                           one GEMM (BGRADB epilogue sums the bias gradient)
              d_pre = (dy w2) * gelu'(pre), db1  one GEMM (DGELU_BGRAD epilogue)
              dw1 = d_pre^T x, dx = d_pre w1     plain GEMMs
and fused_dense's backward gets dw and db from one BGRADB GEMM. Otherwise (CPU, float32, odd shapes,
or `use_backend("reference")`) the plain composition runs. GELU is the tanh approximation in both
paths: cuBLASLt's GELU epilogue implements only that one, so the fallback matches it.

The extension is `import tpflash_fused_dense` (built by `pip install --no-build-isolation -e .`
where CUDA and nvcc exist), or, when TPFLASH_JIT_CUDA=1, built on first use from this checkout's
csrc/ with torch.utils.cpp_extension.load. `extension_status()` says which, or why neither.
Knows nothing of process groups: tensor-parallel callers pass their local weight shards.
Note: `tpflash.kernels.fused_dense` is the function; import this module's other names with
`from tpflash.kernels.fused_dense import ...`.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import dispatch

HALF_DTYPES = (torch.float16, torch.bfloat16)
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc" / "fused_dense"


# ---------------------------------------------------------------------------------------------
# Loading the extension
# ---------------------------------------------------------------------------------------------
def build_options_module():
    """csrc/fused_dense/build_options.py of this checkout (sources, flags, where cuBLASLt is)."""
    options_file = CSRC_DIR / "build_options.py"
    if not options_file.is_file():
        raise RuntimeError(f"the JIT build needs a tpflash checkout's csrc/; {options_file} does not exist")
    name = "tpflash_fused_dense_build_options"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, options_file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there while it executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def _jit_build():
    import torch.utils.cpp_extension as cpp

    if cpp.CUDA_HOME is None:
        raise RuntimeError("the JIT build needs nvcc, but CUDA_HOME was not found")
    build = build_options_module()
    scratch = Path(tempfile.gettempdir()) / f"tpflash-cublas-include-{os.getuid()}"
    opts = build.build_options(cpp.CUDA_HOME, scratch)
    return cpp.load(name=build.NAME, sources=opts.sources, extra_include_paths=opts.include_dirs,
                    extra_cflags=opts.cxx_flags, extra_cuda_cflags=opts.nvcc_flags, extra_ldflags=opts.ldflags,
                    verbose=os.environ.get("TPFLASH_JIT_VERBOSE", "0") == "1")


@functools.lru_cache(maxsize=None)
def _load() -> Tuple[Optional[object], str]:
    """(module or None, how it was loaded or why not); tried once per process."""
    try:
        import tpflash_fused_dense
        return tpflash_fused_dense, f"installed module {tpflash_fused_dense.__file__}"
    except ImportError as exc:
        reason = f"import tpflash_fused_dense failed ({exc})"
    if os.environ.get("TPFLASH_JIT_CUDA", "0") != "1":
        return None, reason + "; TPFLASH_JIT_CUDA is not 1, so no JIT build was tried"
    if not torch.cuda.is_available():
        return None, reason + "; no JIT build without CUDA"
    try:
        module = _jit_build()
        return module, f"JIT-built {module.__file__}"
    except Exception as exc:  # keep the whole compiler output: it is the only report of a failed build
        return None, f"{reason}; the JIT build failed:\n{exc}"


def load_extension():
    """The compiled `tpflash_fused_dense` module, or None (see `extension_status`)."""
    return _load()[0]


def extension_status() -> str:
    """How the extension was loaded, or why it was not (the full compiler output of a failed JIT build)."""
    return _load()[1]


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------
def _autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    try:
        enabled = torch.is_autocast_enabled(x.device.type)
        return torch.get_autocast_dtype(x.device.type) if enabled else None
    except TypeError:  # torch < 2.4: the device-less CUDA-only API
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _prepare(x: torch.Tensor, weights, biases):
    """(x2d, weights, biases) cast and flattened for the extension, or None where the composition runs.

    Eligible: a CUDA x, one float16/bfloat16 dtype (or autocast to one), every weight dim a multiple
    of 8 (cuBLASLt's alignment and its GELU buffer's leading dimension), at least one row."""
    if dispatch.requested_backend() == "reference" or not x.is_cuda or x.numel() == 0:
        return None
    params = [t for t in (*weights, *biases) if t is not None]
    dtype = _autocast_dtype(x)
    if dtype is None:
        dtype = x.dtype
        if any(t.dtype != dtype for t in params):
            return None
    if dtype not in HALF_DTYPES or any(t.device != x.device for t in params):
        return None
    if any(d % 8 for w in weights for d in w.shape) or load_extension() is None:
        return None
    x2d = x.to(dtype).reshape(-1, x.shape[-1]).contiguous()
    weights = [w.to(dtype).contiguous() for w in weights]
    biases = [b if b is None else b.to(dtype).contiguous() for b in biases]
    if not all(_aligned(t) for t in [x2d, *weights, *(b for b in biases if b is not None)]):
        return None
    return x2d, weights, biases


def _unflatten(out2d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[M, N] -> [*x.shape[:-1], N]; a 2-D x gets the Function's output itself (its grad_fn shows the path)."""
    return out2d if x.dim() == 2 else out2d.view(*x.shape[:-1], out2d.shape[-1])


def _check_linear(in_features: int, weight, bias, name: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if in_features != weight.shape[1]:
        raise ValueError(f"{name}.shape[1]={weight.shape[1]} must equal its input's last dim {in_features}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias of {name} has shape {tuple(bias.shape)}, must be [{weight.shape[0]}]")


# ---------------------------------------------------------------------------------------------
# Autograd functions (2-D inputs already prepared by `_prepare`)
# ---------------------------------------------------------------------------------------------
class FusedDense(torch.autograd.Function):
    """y = x @ weight^T + bias on [M, K] x [N, K]; the backward gets dweight and dbias from one GEMM."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)  # [M, N]

    @staticmethod
    def backward(ctx, d_out):
        x, weight = ctx.saved_tensors
        d_out = d_out.contiguous()  # [M, N]
        d_x = d_out @ weight if ctx.needs_input_grad[0] else None  # [M, K]
        d_weight = d_bias = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grads = load_extension().linear_weight_grad(x, d_out, ctx.has_bias)
            d_weight = grads[0] if ctx.needs_input_grad[1] else None
            d_bias = grads[1] if ctx.has_bias and ctx.needs_input_grad[2] else None
        return d_x, d_weight, d_bias


class FusedDenseGeluDense(torch.autograd.Function):
    """y = gelu_tanh(x @ w1^T + b1) @ w2^T + b2 on x [M, K], w1 [F, K], w2 [D, F] (see module docstring).

    Saves x, w1, w2 and two [M, F] tensors (the GELU input and output), as the composition does."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, heuristic: int = 0):
        ext = load_extension()
        bias1 = b1 if b1 is not None else x.new_zeros(w1.shape[0])  # the epilogue always adds a bias
        h, pre = ext.linear_gelu_forward(x, w1, bias1, heuristic)  # [M, F] each
        ctx.save_for_backward(x, w1, w2, pre, h)
        ctx.has_b1, ctx.has_b2, ctx.heuristic = b1 is not None, b2 is not None, heuristic
        return F.linear(h, w2, b2)  # [M, D]

    @staticmethod
    def backward(ctx, d_out):
        x, w1, w2, pre, h = ctx.saved_tensors
        ext = load_extension()
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        d_out = d_out.contiguous()  # [M, D]
        d_w2 = d_b2 = None
        if need_w2 or need_b2:
            grads = ext.linear_weight_grad(h, d_out, ctx.has_b2)  # [D, F], [D]
            d_w2 = grads[0] if need_w2 else None
            d_b2 = grads[1] if ctx.has_b2 and need_b2 else None
        d_pre, d_b1 = ext.linear_dgelu_bias_grad(w2, d_out, pre, ctx.heuristic)  # [M, F], [F]
        d_w1 = ext.linear_weight_grad(x, d_pre, False)[0] if need_w1 else None  # [F, K]
        d_x = d_pre @ w1 if need_x else None  # [M, K]
        return d_x, d_w1, d_b1 if ctx.has_b1 and need_b1 else None, d_w2, d_b2, None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
def dense_gelu_dense_reference(x, w1, b1, w2, b2):
    """The plain composition F.linear -> GELU (tanh) -> F.linear: the fallback and the tests' reference."""
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def fused_dense(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ weight^T + bias: x [..., in], weight [out, in], bias [out] or None -> [..., out].

    Same result as F.linear; on the extension path the backward computes dweight and dbias in one
    cuBLASLt GEMM (BGRADB epilogue). Differentiable in every tensor argument."""
    _check_linear(x.shape[-1], weight, bias, "weight")
    prepared = _prepare(x, [weight], [bias])
    if prepared is None:
        return F.linear(x, weight, bias)
    x2d, (weight,), (bias,) = prepared
    return _unflatten(FusedDense.apply(x2d, weight, bias), x)


def fused_dense_gelu_dense(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                           b2: Optional[torch.Tensor] = None, *, heuristic: int = 0) -> torch.Tensor:
    """gelu_tanh(x @ w1^T + b1) @ w2^T + b2: the two dense layers of a GELU MLP.

    x [..., in], w1 [hidden, in], b1 [hidden] or None, w2 [out, hidden], b2 [out] or None -> [..., out].
    Tensor parallel: pass the local shards (w1/b1 split over hidden as a column-parallel layer, w2 as a
    row-parallel one) and b2=None; the caller reduces the partial output over tp, then adds b2.
    heuristic: which of cuBLASLt's ranked algorithms the GELU GEMMs use (0 = its first choice).
    Differentiable in every tensor argument."""
    _check_linear(x.shape[-1], w1, b1, "w1")
    _check_linear(w1.shape[0], w2, b2, "w2")
    prepared = _prepare(x, [w1, w2], [b1, b2])
    if prepared is None:
        return dense_gelu_dense_reference(x, w1, b1, w2, b2)
    x2d, (w1, w2), (b1, b2) = prepared
    return _unflatten(FusedDenseGeluDense.apply(x2d, w1, b1, w2, b2, heuristic), x)
