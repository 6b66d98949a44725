"""bias_activation: act(y + bias) and its backward (dy and the fused bias-gradient sum) vs float64."""

import pytest
import torch

from tests.kernels.helpers import (DEVICE, assert_rel, compiled_for_h100, float64_twin, h100_program, needs_interpreter,
                                   run_with_grads)
from tpflash.kernels import bias_activation, use_backend

ACTS = ["gelu", "gelu_exact", "relu"]


def _check(shape, dtype, activation, device="cpu"):
    torch.manual_seed(0)
    n = shape[-1]
    y = (2 * torch.randn(*shape, device=device)).to(dtype)
    bias = torch.randn(n, device=device)  # fp32, as a parameter under autocast
    dh = torch.randn(*shape, device=device).to(dtype)
    fn = lambda y, b: bias_activation(y, b, activation)  # noqa: E731
    (out,), (dy, dbias) = run_with_grads(fn, [y, bias], [dh])
    (ref,), (ref_dy, ref_dbias) = float64_twin(fn, [y, bias], [dh])
    assert out.dtype == dtype and dy.dtype == dtype and dbias.dtype == torch.float32
    name = f"{activation} {tuple(shape)} {dtype}"
    assert_rel(out, ref, dtype, f"out {name}")
    assert_rel(dy, ref_dy, dtype, f"dy {name}")
    assert_rel(dbias, ref_dbias, dtype, f"dbias {name}")  # the sum of rounded dy: dy's tolerance


@needs_interpreter
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(37, 5), (300, 130), (6, 5, 40)], ids=["37x5", "300x130", "3d"])
def test_bias_activation_matches_float64(shape, dtype, activation):
    _check(shape, dtype, activation)


@needs_interpreter
def test_bias_activation_reads_a_strided_input():
    # a column slice of a wider product (row stride 40): the kernel takes the row stride
    y = torch.randn(70, 40)[:, 3:33]
    bias = torch.randn(30)
    with use_backend("triton"):
        out = bias_activation(y, bias, "gelu")
    assert_rel(out, torch.nn.functional.gelu(y.double() + bias.double(), approximate="tanh"), torch.float32)


@needs_interpreter
def test_bias_activation_backward_repeats_its_bits():
    torch.manual_seed(1)
    y, dh = torch.randn(300, 130).bfloat16(), torch.randn(300, 130).bfloat16()
    bias = torch.randn(130, requires_grad=True)
    grads = [run_with_grads(lambda y, b: bias_activation(y, b), [y, bias], [dh])[1] for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("rows", [1, 8192, 200_000, 3_000_000])
def test_bias_activation_grid_covers_every_row_within_the_grid_limit(rows, backward):
    # the GPU launch rule (one row per program in the forward) must not exceed the grid's 65535 splits
    from tpflash.kernels.bias_activation_kernel import LAUNCH, MAX_SPLITS, _grid_rows
    cfg = LAUNCH[backward]
    rows_per_split, splits = _grid_rows(rows, 8, 132, cfg)
    assert splits <= MAX_SPLITS and rows_per_split % cfg["BLOCK_R"] == 0
    assert (splits - 1) * rows_per_split < rows <= splits * rows_per_split


def test_bias_activation_rejects_an_unknown_activation():
    with pytest.raises(ValueError, match=r"activation='swish' must be one of \('gelu', 'gelu_exact', 'relu'\)"):
        bias_activation(torch.zeros(2, 4), torch.zeros(4), "swish")


def test_bias_activation_rejects_a_bias_of_the_wrong_size():
    with pytest.raises(ValueError, match=r"bias shape \(3,\) must be \[4\]"):
        bias_activation(torch.zeros(2, 4), torch.zeros(3))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("shape", [(8192, 8192), (8191, 2050)])
def test_bias_activation_matches_float64_on_gpu(shape, activation):
    _check(shape, torch.bfloat16, activation, DEVICE)


_COMPILE_FOR_H100 = h100_program("bias_activation", """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpflash.kernels.bias_activation_kernel import ACTIVATION_IDS, _bias_activation_kernel
signature = {"Y": "*bf16", "BIAS": "*fp32", "DH": "*bf16", "OUT": "*bf16", "PARTIALS": "*fp32", "rows": "i32",
             "cols": "i32", "stride_y": "i32", "stride_dh": "i32", "rows_per_split": "i32", "ACT": "constexpr",
             "BACKWARD": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr",
             "STAGES": "constexpr"}
for act in ACTIVATION_IDS.values():
    for backward in (False, True):
        constexprs = {"ACT": act, "BACKWARD": backward, "BLOCK_R": 128, "BLOCK_C": 32, "STAGES": 3}
        compiled = triton.compile(ASTSource(_bias_activation_kernel, signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], (act, backward)
print("compiled", 2 * len(ACTIVATION_IDS))
""")


def test_bias_activation_kernel_compiles_for_an_h100():
    # The interpreter runs the kernel as Python; Triton's compiler (here to sm_90 machine code, no GPU
    # needed) rejects what the interpreter lets through, e.g. a kernel reading a plain Python global.
    # A fresh process without TRITON_INTERPRET, where @triton.jit gives compilable kernels.
    assert "compiled 6" in compiled_for_h100(_COMPILE_FOR_H100)
