"""clipped_step: clipping by the global norm, done inside a fused AdamW's own kernel or by
clip_grads_ before any other optimizer's step, with the same result."""
import pytest
import torch

from tpflash.train.gradients import clip_grads_, clipped_step


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _params_with_grads(scale: float, device: str = "cpu"):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8, device=device)), torch.nn.Parameter(torch.randn(8, device=device))]
    for p in params:
        p.grad = scale * torch.randn_like(p)
    return params


def _norm(params):
    return torch.stack([p.grad.norm() for p in params]).norm()


def _after_two_steps(fused: bool, fold: bool, grad_scale: float, max_norm: float, device: str = "cpu"):
    params = _params_with_grads(grad_scale, device)
    grads = [p.grad.clone() for p in params]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, fused=fused or None, foreach=None if fused else True)
    for _ in range(2):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if fold:
            clipped_step(opt, params, _norm(params), max_norm)
        else:
            clip_grads_(params, _norm(params), max_norm)
            opt.step()
    assert not hasattr(opt, "grad_scale"), "the step's grad_scale must not outlive it"
    return [p.detach() for p in params], [p.grad for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_scale", [10.0, 1e-3], ids=["norm_above_max", "norm_below_max"])
def test_fused_adamw_clipping_in_its_kernel_matches_clip_grads_then_step(grad_scale, device):
    want_params, want_grads = _after_two_steps(True, False, grad_scale, max_norm=1.0, device=device)
    got_params, got_grads = _after_two_steps(True, True, grad_scale, max_norm=1.0, device=device)
    for got, want in zip(got_params + got_grads, want_params + want_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_clipped_step_leaves_the_gradient_norm_at_max_norm():
    grads = _after_two_steps(fused=True, fold=True, grad_scale=10.0, max_norm=1.0)[1]
    assert abs(torch.stack([g.norm() for g in grads]).norm().item() - 1.0) < 1e-4


def test_fused_adamw_is_handed_the_clipping_as_its_grad_scale():
    params = _params_with_grads(10.0)
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    seen, step = [], opt.step
    opt.step = lambda: (seen.append(getattr(opt, "grad_scale", None)), step())
    norm = _norm(params)
    clipped_step(opt, params, norm, 2.0)
    assert seen[0] is not None and torch.allclose(seen[0], norm / 2.0), seen


def test_foreach_adamw_is_clipped_by_clip_grads_before_its_step():
    want = _after_two_steps(fused=False, fold=False, grad_scale=10.0, max_norm=1.0)[0]
    got = _after_two_steps(fused=False, fold=True, grad_scale=10.0, max_norm=1.0)[0]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_max_norm_zero_steps_on_the_unclipped_gradients():
    params = _params_with_grads(10.0)
    before = [p.grad.clone() for p in params]
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    clipped_step(opt, params, _norm(params), 0.0)
    for p, g in zip(params, before):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_a_norm_that_is_not_a_tensor_is_refused_before_the_step():
    params = _params_with_grads(1.0)
    opt = torch.optim.AdamW(params, lr=0.1, fused=True)
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match="total_norm must be a tensor .* got float 3.0"):
        clipped_step(opt, params, 3.0, 1.0)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)

