"""bias_activation: act(y + bias) and its backward (dy and the fused bias-gradient sum) vs float64."""
import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_rel, float64_twin, needs_interpreter, run_with_grads
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
