"""swiglu: silu(gate) * up and its backward vs float64, on strided halves of one GEMM output, and the
backward's one [*, 2n] gradient buffer for adjacent halves."""

import pytest
import torch

from tests.kernels.helpers import (DEVICE, assert_rel, compiled_for_h100, float64_twin, h100_program, needs_interpreter,
                                   run_with_grads)
from tpflash.kernels import swiglu, use_backend
from tpflash.kernels.column_sum import joined_column_blocks


def _check(shape, dtype, device="cpu"):
    torch.manual_seed(0)
    up = (2 * torch.randn(*shape, device=device)).to(dtype)
    gate = (2 * torch.randn(*shape, device=device)).to(dtype)
    dh = torch.randn(*shape, device=device).to(dtype)
    (out,), (d_up, d_gate) = run_with_grads(swiglu, [up, gate], [dh])
    (ref,), (ref_up, ref_gate) = float64_twin(swiglu, [up, gate], [dh])
    assert out.dtype == d_up.dtype == d_gate.dtype == dtype
    name = f"{tuple(shape)} {dtype}"
    assert_rel(out, ref, dtype, f"out {name}")
    assert_rel(d_up, ref_up, dtype, f"d_up {name}")
    assert_rel(d_gate, ref_gate, dtype, f"d_gate {name}")


def _stacked(rows, n, dtype=torch.float32, device="cpu"):
    """A leaf y [rows, 2n] (the stacked GEMM's output), its halves up, gate, and an upstream dh."""
    torch.manual_seed(0)
    y = (2 * torch.randn(rows, 2 * n, device=device)).to(dtype).requires_grad_()
    return y, y[:, :n], y[:, n:], torch.randn(rows, n, device=device).to(dtype)


def _triton_grads(up, gate, dh):
    with use_backend("triton"):
        h = swiglu(up, gate)
    return torch.autograd.grad(h, [up, gate], dh)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(37, 5), (300, 130), (6, 5, 40)], ids=["37x5", "300x130", "3d"])
def test_swiglu_matches_float64(shape, dtype):
    _check(shape, dtype)


@needs_interpreter
def test_swiglu_reads_the_strided_halves_of_one_product():
    # row stride 2n: the kernel takes each operand's row stride, no copy
    y, up, gate, _ = _stacked(70, 33)
    with use_backend("triton"):
        out = swiglu(up, gate)
        expected = swiglu(up.contiguous(), gate.contiguous())
    assert out.is_contiguous() and torch.equal(out, expected)


@needs_interpreter
def test_swiglu_backward_of_adjacent_halves_writes_one_buffer():
    # autograd hands back for the non-leaf views up and gate what the backward returned for them
    y, up, gate, dh = _stacked(37, 20)
    d_up, d_gate = _triton_grads(up, gate, dh)
    assert joined_column_blocks([d_up, d_gate]) is not None, (d_up.stride(), d_gate.stride())
    assert d_up.untyped_storage().data_ptr() == d_gate.untyped_storage().data_ptr()
    ref_up, ref_gate = _triton_grads(up.contiguous(), gate.contiguous(), dh)  # separate: two tensors
    assert torch.equal(d_up, ref_up) and torch.equal(d_gate, ref_gate)


@needs_interpreter
@pytest.mark.parametrize("layout", ["separate", "swapped", "gap"])
def test_swiglu_backward_of_non_adjacent_inputs_is_right(layout):
    torch.manual_seed(0)
    rows, n = 37, 20
    y = torch.randn(rows, 3 * n, requires_grad=True)
    up, gate = {"separate": (y[:, :n].clone(), y[:, n:2 * n].clone()),
                "swapped": (y[:, n:2 * n], y[:, :n]),  # [gate | up]: adjacent, but not in order
                "gap": (y[:, :n], y[:, 2 * n:])}[layout]  # row stride 3n
    dh = torch.randn(rows, n)
    assert joined_column_blocks([up, gate]) is None
    d_up, d_gate = _triton_grads(up, gate, dh)
    assert d_up.is_contiguous() and d_gate.is_contiguous()
    _, (ref_up, ref_gate) = float64_twin(swiglu, [up, gate], [dh])
    assert_rel(d_up, ref_up, torch.float32, f"d_up {layout}")
    assert_rel(d_gate, ref_gate, torch.float32, f"d_gate {layout}")


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(37, 10), (6, 5, 80)], ids=["2d", "3d"])
def test_swiglu_gradient_of_the_stacked_product_matches_float64(shape, dtype):
    torch.manual_seed(0)
    n = shape[-1] // 2
    y = (2 * torch.randn(*shape)).to(dtype)
    dh = torch.randn(*shape[:-1], n).to(dtype)
    fn = lambda y: swiglu(y[..., :n], y[..., n:])  # noqa: E731
    (out,), (dy,) = run_with_grads(fn, [y], [dh])
    (ref,), (ref_dy,) = float64_twin(fn, [y], [dh])
    assert_rel(out, ref, dtype, "out")
    assert_rel(dy, ref_dy, dtype, "dy")


@needs_interpreter
def test_swiglu_programs_loop_over_rows_past_the_grid_limit(monkeypatch):
    # a CPU-sized stand-in for inputs with more row tiles than the grid has room for
    import tpflash.kernels.swiglu_kernel as kernel
    monkeypatch.setattr(kernel, "MAX_ROW_PROGRAMS", 2)
    y, up, gate, dh = _stacked(300, 37)
    d_up, d_gate = _triton_grads(up, gate, dh)
    with use_backend("triton"):
        out = swiglu(up, gate)
    (ref,), (ref_up, ref_gate) = float64_twin(swiglu, [up, gate], [dh])
    assert_rel(out, ref, torch.float32, "out")
    assert_rel(d_up, ref_up, torch.float32, "d_up")
    assert_rel(d_gate, ref_gate, torch.float32, "d_gate")


@needs_interpreter
def test_swiglu_backward_repeats_its_bits():
    y, up, gate, dh = _stacked(300, 130, torch.bfloat16)
    first, second = _triton_grads(up, gate, dh), _triton_grads(up, gate, dh)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("rows", [1, 8192, 65535, 65536, 200_000, 3_000_000])
def test_swiglu_grid_covers_every_row_within_the_grid_limit(rows, backward):
    from tpflash.kernels.swiglu_kernel import LAUNCH, MAX_ROW_PROGRAMS, _grid_rows
    cfg = LAUNCH[backward]
    rows_per_program, programs = _grid_rows(rows, cfg)
    assert programs <= MAX_ROW_PROGRAMS and rows_per_program % cfg["BLOCK_R"] == 0
    assert (programs - 1) * rows_per_program < rows <= programs * rows_per_program


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_interpreter), "reference"])
def test_swiglu_writes_the_amaxes_of_its_output_and_of_its_gradients(backend, monkeypatch):
    """The amaxes fp8 tensorwise GEMMs take from it: max |h| as h is stored, and max |.| over d_up and
    d_gate, written by the backward before it returns them."""
    from tpflash.kernels import swiglu_kernel
    monkeypatch.setattr(swiglu_kernel, "AMAX_ROWS_PER_PROGRAM", 32)  # 37 rows: programs of two tiles and of one
    y, up, gate, dh = _stacked(37, 80, torch.bfloat16)
    dh[5, 7] = 30.0  # the gradients' amax somewhere in the middle
    h_amax, grad_amax = torch.full((), -1.0), torch.full((), -1.0)
    with use_backend(backend):
        h = swiglu(up, gate, (h_amax, grad_amax))
        assert h_amax == h.float().abs().max()
        h.backward(dh)
        assert torch.equal(h, swiglu(up.detach(), gate.detach()))  # the amaxes change nothing else
    assert grad_amax == y.grad.float().abs().max()


@needs_interpreter
def test_swiglu_amaxes_are_nan_where_a_value_is():
    y, up, gate, dh = _stacked(16, 40, torch.bfloat16)
    dh[3, 3] = float("nan")
    h_amax, grad_amax = torch.zeros(()), torch.zeros(())
    with use_backend("triton"):
        swiglu(up, gate, (h_amax, grad_amax)).backward(dh)
    assert h_amax.isfinite() and grad_amax.isnan()


def test_swiglu_amaxes_of_another_shape_or_dtype_are_one_clear_error():
    up = gate = torch.ones(4, 8)
    with pytest.raises(ValueError, match=r"amaxes must be two 0-d float32 tensors on up's device, got "
                                         r"\[\(\(1,\), torch.float32, 'cpu'\), \(\(\), torch.bfloat16, 'cpu'\)\]"):
        swiglu(up, gate, (torch.zeros(1), torch.zeros((), dtype=torch.bfloat16)))


def test_swiglu_reference_matches_silu_times_up():
    up, gate = torch.randn(3, 4, 6).bfloat16(), torch.randn(3, 4, 6).bfloat16()
    out = swiglu(up, gate)  # the reference on CPU
    assert out.dtype == torch.bfloat16
    assert_rel(out, torch.nn.functional.silu(gate.double()) * up.double(), torch.bfloat16)


def test_swiglu_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"up \(2, 4\) and gate \(2, 5\) must be \[\*, n\] of one shape"):
        swiglu(torch.zeros(2, 4), torch.zeros(2, 5))


def test_swiglu_rejects_mismatched_dtypes():
    with pytest.raises(ValueError, match=r"up is torch.float32 on cpu, gate torch.bfloat16 on cpu"):
        swiglu(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16))


def test_swiglu_rejects_a_strided_last_dim():
    with pytest.raises(ValueError, match=r"gate \(4, 3\) has strides \(1, 4\); its last dim must have stride 1"):
        swiglu(torch.zeros(4, 3), torch.zeros(3, 4).t())


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [False, True], ids=["separate", "stacked"])
@pytest.mark.parametrize("rows, n", [(8192, 5632), (8191, 1375)])
def test_swiglu_matches_float64_on_gpu(rows, n, stacked):
    if not stacked:
        _check((rows, n), torch.bfloat16, DEVICE)
        return
    y, up, gate, dh = _stacked(rows, n, torch.bfloat16, DEVICE)
    d_up, d_gate = _triton_grads(up, gate, dh)
    assert joined_column_blocks([d_up, d_gate]) is not None
    _, (ref_up, ref_gate) = float64_twin(swiglu, [up, gate], [dh])
    assert_rel(d_up, ref_up, torch.bfloat16, "d_up")
    assert_rel(d_gate, ref_gate, torch.bfloat16, "d_gate")


_COMPILE_FOR_H100 = h100_program("swiglu", """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpflash.kernels.swiglu_kernel import LAUNCH, _swiglu_kernel
signature = {"UP": "*bf16", "GATE": "*bf16", "DH": "*bf16", "OUT": "*bf16", "OUT_GATE": "*bf16", "AMAX": "*fp32",
             "rows": "i32", "cols": "i32", "stride_up": "i64", "stride_gate": "i64", "stride_dh": "i64",
             "stride_out": "i64", "rows_per_program": "i32", "BACKWARD": "constexpr", "WITH_AMAX": "constexpr",
             "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}
n = 0
for backward, cfg in LAUNCH.items():
    for with_amax in (False, True):
        constexprs = {"BACKWARD": backward, "WITH_AMAX": with_amax, "BLOCK_R": cfg["BLOCK_R"], "BLOCK_C": cfg["BLOCK_C"]}
        compiled = triton.compile(ASTSource(_swiglu_kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["WARPS"]})
        n += bool(compiled.asm["cubin"])
import triton.language as tl
from tpflash.kernels.swiglu_kernel import FP8_LAUNCH, HISTORY_BLOCK, _swiglu_fp8_kernel
fp8_signature = {"UP": "*bf16", "GATE": "*bf16", "DH": "*bf16", "OUT_ROW": "*fp8e5", "OUT_COL": "*fp8e5",
                 "SCALE": "*fp32", "HISTORY": "*fp32", "RECORD": "*i32", "rows": "i32", "cols": "i32",
                 "stride_up": "i64", "stride_gate": "i64", "stride_dh": "i64", "history_count": "i32"}
fp8_signature.update({k: "constexpr" for k in ("BACKWARD", "ROUND_TO", "FP8_MAX", "MANTISSA", "MIN_EXP", "BLOCK_R", "BLOCK_C",
                                               "BLOCK_A")})
cfg = FP8_LAUNCH
for backward, (fp8_max, mantissa, min_exp, fp8_type) in ((True, (57344.0, 2, -14, "*fp8e5")),
                                                           (False, (448.0, 3, -6, "*fp8e4nv"))):
    constexprs = {"BACKWARD": backward, "ROUND_TO": tl.bfloat16, "FP8_MAX": fp8_max, "MANTISSA": mantissa,
                  "MIN_EXP": min_exp, "BLOCK_R": cfg["BLOCK_R"], "BLOCK_C": cfg["BLOCK_C"], "BLOCK_A": HISTORY_BLOCK}
    signature = dict(fp8_signature, OUT_ROW=fp8_type, OUT_COL=fp8_type)
    compiled = triton.compile(ASTSource(_swiglu_fp8_kernel, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["WARPS"]})
    n += bool(compiled.asm["cubin"])
print("compiled", n)
""")


def test_swiglu_kernel_compiles_for_an_h100():
    # the interpreter lets through what Triton's compiler rejects (bias_activation's test says more)
    assert "compiled 6" in compiled_for_h100(_COMPILE_FOR_H100)
