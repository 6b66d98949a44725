"""tpflash.layers.autocast_linear.linear: F.linear under autocast, weight/bias gradients straight in fp32."""
import os

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DEVICE, assert_rel
from tpflash.kernels import weight_grad
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
    # written in fp32 (the fp32-output GEMM on CUDA, an fp32 GEMM on CPU), the weight gradient skips
    # autocast's rounding to bf16
    assert_rel(gw, gw_true, torch.bfloat16, "weight grad", scale=0.1)
    assert_rel(gw0, gw_true, torch.bfloat16, "autocast weight grad")
    assert_rel(gb, dyd.reshape(-1, 24).sum(0), torch.float32, "bias grad", scale=10)


def test_linear_under_autocast_matches_f_linear_with_fp32_weight_grads():
    _check_against_autocast_and_fp64("cpu")


@pytest.mark.gpu
def test_linear_under_autocast_uses_fp32_output_gemm_on_gpu():
    _check_against_autocast_and_fp64(DEVICE)
    assert weight_grad._MM_OUT_DTYPE[0] is True, "torch.mm(out_dtype=float32) was not used"


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


def test_add_bias_keeps_a_bf16_output_bf16_and_sums_the_bias_gradient_in_fp32():
    from tpflash.layers.autocast_linear import add_bias
    torch.manual_seed(0)
    y = torch.randn(64, 3, 16).to(torch.bfloat16).requires_grad_()
    b = torch.randn(16, requires_grad=True)
    out = add_bias(y, b)
    assert out.dtype == torch.bfloat16, "an fp32 bias promoted the bf16 activation"
    assert torch.equal(out, y + b.to(torch.bfloat16))
    dy = torch.randn(64, 3, 16).to(torch.bfloat16)
    out.backward(dy)
    assert torch.equal(y.grad, dy)
    assert b.grad.dtype == torch.float32
    assert_rel(b.grad, dy.double().reshape(-1, 16).sum(0), torch.float32, "bias grad")


def test_row_parallel_linear_at_tp1_puts_the_bias_in_the_gemm_under_autocast():
    from tpflash.layers import RowParallelLinear
    torch.manual_seed(0)
    layer = RowParallelLinear(32, 24)
    x = torch.randn(6, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y0 = layer(x), F.linear(x, layer.weight, layer.bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y0)


def _stacked_case(bias):
    torch.manual_seed(0)
    x = torch.randn(6, 5, 32)
    ws = [(0.2 * torch.randn(n, 32)).requires_grad_() for n in (24, 8, 8)]
    bs = [torch.randn(n).requires_grad_() if bias else None for n in (24, 8, 8)]
    dys = [torch.randn(6, 5, n) for n in (24, 8, 8)]
    return x, ws, bs, dys


def _grads(fn, x, ws, bs, dys, autocast):
    x = x.clone().requires_grad_()
    for p in ws + [b for b in bs if b is not None]:
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ys = fn(x, ws, bs)
    torch.autograd.backward(ys, [dy.to(y.dtype) for y, dy in zip(ys, dys)])
    return ys, [x.grad] + [p.grad for p in ws + [b for b in bs if b is not None]]


@pytest.mark.parametrize("bias", [True, False])
def test_linears_equal_one_linear_per_weight_forward_and_backward(bias):
    from tpflash.layers.autocast_linear import linears
    case = _stacked_case(bias)
    ys, grads = _grads(linears, *case, autocast=False)
    ys0, grads0 = _grads(lambda x, ws, bs: [F.linear(x, w, b) for w, b in zip(ws, bs)], *case, autocast=False)
    for y, y0 in zip(ys, ys0):
        torch.testing.assert_close(y, y0)
    for g, g0 in zip(grads, grads0):
        assert g.dtype == g0.dtype
        torch.testing.assert_close(g, g0)


def test_linears_with_bf16_weights_give_bf16_weight_grads_as_one_linear_per_weight():
    # FSDP's all-gathered weights are bf16: the stacked GEMM's weight gradients come out in bf16 directly
    from tpflash.layers.autocast_linear import linears
    x, ws, bs, dys = _stacked_case(False)
    x = x.bfloat16()
    ws = [w.detach().bfloat16().requires_grad_() for w in ws]
    dys = [dy.bfloat16() for dy in dys]
    ys, grads = _grads(linears, x, ws, bs, dys, autocast=False)
    ys0, grads0 = _grads(lambda x, ws, bs: [F.linear(x, w, b) for w, b in zip(ws, bs)], x, ws, bs, dys,
                         autocast=False)
    for g, g0 in zip(grads, grads0):
        assert g.dtype == g0.dtype == torch.bfloat16
        torch.testing.assert_close(g, g0, rtol=1.6e-2, atol=1e-2)


def test_linears_under_autocast_match_linear_per_weight_with_fp32_parameter_grads():
    from tpflash.layers.autocast_linear import linears
    case = _stacked_case(True)
    ys, grads = _grads(linears, *case, autocast=True)
    ys0, grads0 = _grads(lambda x, ws, bs: [linear(x, w, b) for w, b in zip(ws, bs)], *case, autocast=True)
    for y, y0 in zip(ys, ys0):
        assert y.dtype == torch.bfloat16
        assert_rel(y.float(), y0.float(), torch.bfloat16, "output")
    for g, g0 in zip(grads, grads0):
        assert g.dtype == torch.float32 and g0.dtype == torch.float32
        assert_rel(g, g0, torch.bfloat16, "gradient")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                    reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_linears_with_the_triton_concat_and_bias_sum_equal_one_linear_per_weight():
    # the stacked backward's concatenation and bias sums through kernels.concat_with_column_sum (Triton)
    from tpflash.kernels import use_backend
    from tpflash.layers.autocast_linear import linears
    case = _stacked_case(True)
    with use_backend("triton"):
        _, grads = _grads(linears, *case, autocast=False)
    _, grads0 = _grads(lambda x, ws, bs: [F.linear(x, w, b) for w, b in zip(ws, bs)], *case, autocast=False)
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g, g0)


def test_linears_leave_an_unused_output_with_zero_weight_gradient():
    from tpflash.layers.autocast_linear import linears
    x, ws, bs, _ = _stacked_case(True)
    q, k, v = linears(x, ws, bs)
    (q.sum() + v.sum()).backward()
    assert torch.count_nonzero(ws[1].grad) == 0 and torch.count_nonzero(bs[1].grad) == 0
    torch.testing.assert_close(bs[0].grad, torch.full((24,), 30.0))


def test_linears_without_gradients_do_not_stack_the_weights():
    from tpflash.layers.autocast_linear import linears
    x, ws, bs, _ = _stacked_case(True)
    with torch.no_grad():
        ys = linears(x, ws, bs)
    assert all(torch.equal(y, F.linear(x, w, b)) for y, w, b in zip(ys, ws, bs))
    assert ys[0].is_contiguous(), "inference stacked the weights (outputs are column slices of one product)"


def test_linears_with_biases_on_some_weights_only_equal_one_linear_per_weight():
    from tpflash.layers.autocast_linear import linears
    x, ws, bs, dys = _stacked_case(True)
    bs = [bs[0], None, bs[2]]
    ys, grads = _grads(linears, x, ws, bs, dys, autocast=False)
    ys0, grads0 = _grads(lambda x, ws, bs: [F.linear(x, w, b) for w, b in zip(ws, bs)], x, ws, bs, dys,
                         autocast=False)
    for a, b in zip(ys + grads, ys0 + grads0):
        torch.testing.assert_close(a, b)


def test_linears_reject_a_weight_of_another_input_size_naming_it():
    from tpflash.layers.autocast_linear import linears
    x, ws, bs, _ = _stacked_case(True)
    ws[1] = torch.randn(8, 31, requires_grad=True)
    with pytest.raises(ValueError, match=r"weight 1 has shape \(8, 31\), but the input's last dim is 32"):
        linears(x, ws, bs)
    with pytest.raises(ValueError, match="3 weights but 2 biases"):
        linears(x, ws, bs[:2])


class _ScaleBoth(torch.autograd.Function):
    """(2a, 3b); the backward returns its gradients as the two column blocks of one buffer when
    `joined`, as tpflash.kernels.swiglu's backward does, else as two tensors."""

    @staticmethod
    def forward(ctx, a, b, joined):
        ctx.joined = joined
        return 2 * a, 3 * b

    @staticmethod
    def backward(ctx, ga, gb):
        if not ctx.joined:
            return 2 * ga, 3 * gb, None
        buf = torch.empty(ga.shape[:-1] + (ga.shape[-1] + gb.shape[-1],), dtype=ga.dtype)
        buf[..., :ga.shape[-1]], buf[..., ga.shape[-1]:] = 2 * ga, 3 * gb
        return buf[..., :ga.shape[-1]], buf[..., ga.shape[-1]:], None


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_linears_take_a_joined_gradient_without_copying_it(monkeypatch, bias):
    from tpflash.layers.autocast_linear import linears
    torch.manual_seed(0)
    x = torch.randn(6, 5, 32)
    ws = [(0.2 * torch.randn(n, 32)).requires_grad_() for n in (24, 16)]
    bs = [torch.randn(n).requires_grad_() if bias else None for n in (24, 16)]

    def grads(joined):
        for p in ws + [b for b in bs if b is not None]:
            p.grad = None
        xx = x.clone().requires_grad_()
        y1, y2 = linears(xx, ws, bs)
        a, b = _ScaleBoth.apply(y1, y2, joined)
        if joined:  # the joined gradient must reach the GEMMs as it is: no torch.cat from here on
            monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("the joined gradient was copied"))
        (a.square().sum() + b.sum()).backward()
        monkeypatch.undo()
        return [xx.grad] + [p.grad for p in ws + bs if p is not None]

    for got, want in zip(grads(True), grads(False)):
        assert torch.allclose(got, want, atol=1e-5)
