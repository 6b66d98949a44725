"""tpflash.layers.autocast_linear.linear: F.linear under autocast, weight/bias gradients straight in fp32."""
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DEVICE, assert_rel
from tpflash.layers import autocast_linear
from tpflash.layers.autocast_linear import linear


def _case(device, bias=True):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 32, device=device)
    w = (0.2 * torch.randn(24, 32, device=device)).requires_grad_()
    b = torch.randn(24, device=device).requires_grad_() if bias else None
    dy = torch.randn(6, 5, 24, device=device)
    return x, w, b, dy


def _run(fn, x, w, b, dy, device):
    x = x.clone().requires_grad_()
    w.grad = None
    if b is not None:
        b.grad = None
    with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
        y = fn(x, w, b)
    y.backward(dy.to(y.dtype))
    return y, x.grad, w.grad, None if b is None else b.grad


def _check_against_autocast_and_fp64(device):
    x, w, b, dy = _case(device)
    y, gx, gw, gb = _run(linear, x, w, b, dy, device)
    y0, gx0, gw0, gb0 = _run(F.linear, x, w, b, dy, device)
    assert torch.equal(y, y0), "forward differs from F.linear under autocast"
    assert (gx.dtype, gw.dtype, gb.dtype) == (torch.float32,) * 3
    assert_rel(gx, gx0, torch.bfloat16, "x grad")
    xd, dyd = x.double().to(torch.bfloat16).double(), dy.to(torch.bfloat16).double()
    gw_true = dyd.reshape(-1, 24).t() @ xd.reshape(-1, 32)
    # with the fp32-output GEMM (CUDA) the weight gradient skips autocast's rounding to bf16
    assert_rel(gw, gw_true, torch.bfloat16, "weight grad", scale=0.1 if gw.is_cuda else 1.0)
    assert_rel(gw0, gw_true, torch.bfloat16, "autocast weight grad")
    assert_rel(gb, dyd.reshape(-1, 24).sum(0), torch.float32, "bias grad", scale=10)


def test_linear_under_autocast_matches_f_linear_with_fp32_weight_grads():
    _check_against_autocast_and_fp64("cpu")


@pytest.mark.gpu
def test_linear_under_autocast_uses_fp32_output_gemm_on_gpu():
    _check_against_autocast_and_fp64(DEVICE)
    assert autocast_linear._MM_OUT_DTYPE[0] is True, "torch.mm(out_dtype=float32) was not used"


def test_linear_outside_autocast_is_f_linear():
    x, w, b, _ = _case("cpu")
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert linear(x, w, b).grad_fn.name() == F.linear(x, w, b).grad_fn.name()


def test_linear_without_bias_and_frozen_weight():
    x, w, _, dy = _case("cpu", bias=False)
    y, gx, gw, _ = _run(linear, x, w, None, dy, "cpu")
    assert gw is not None and gw.dtype == torch.float32
    w.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(linear(x, w), F.linear(x, w))
