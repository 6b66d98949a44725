"""MainGrads: each fp32 weight's main_grad buffer, a layer's stacked weights side by side, and what a
backward starts from (tpflash.layers.main_grads)."""
import pytest
import torch

from tpflash.layers.main_grads import MainGrads, main_grad_of
from tpflash.layers.autocast_linear import linear, linears


def _weights(*rows, cols=3):
    return [torch.nn.Parameter(torch.randn(r, cols)) for r in rows]


def test_a_stacked_group_gets_buffers_side_by_side_and_one_stacked_view():
    q, k, v = _weights(4, 2, 2)
    main = MainGrads([(q, k, v)])
    with main.open():
        stacked = main_grad_of([q, k, v])
        assert stacked is not None and stacked.shape == (8, 3)
        assert stacked.data_ptr() == q.main_grad.data_ptr()
        assert torch.equal(stacked[4:6], k.main_grad) and stacked[4:6].data_ptr() == k.main_grad.data_ptr()
        assert main_grad_of([k, q]) is None, "weights out of their stacking order are not one buffer"
    assert not hasattr(q, "main_grad"), "main_grad outlived open()"


def test_biases_norms_and_bf16_weights_get_no_buffer():
    w = _weights(2)[0]
    bias = torch.nn.Parameter(torch.zeros(2))
    half = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.bfloat16))
    main = MainGrads([(w,), (bias,), (half,), (w,)])
    assert main.weights == [w]
    with main.open():
        assert main_grad_of([half]) is None and main_grad_of([w]) is not None


def test_start_zeroes_keeps_or_copies_what_grad_held_and_makes_grad_the_buffer():
    a, b = _weights(2, 2)
    main = MainGrads([(a,), (b,)])
    main.flat.fill_(7.0)  # e.g. what capture warm-ups left
    main.start()
    assert a.grad is main.buffers[0] and b.grad is main.buffers[1]
    assert torch.count_nonzero(main.flat) == 0, "a first backward must start from zeros"
    a.grad.add_(1.0)
    main.start()  # a later micro-batch: nothing touched
    assert torch.equal(a.grad, torch.ones(2, 3))
    outside = torch.full((2, 3), 3.0)
    b.grad = outside
    main.start()
    assert b.grad is main.buffers[1] and torch.equal(b.grad, outside), "an existing .grad was not carried over"
    assert torch.equal(a.grad, torch.ones(2, 3))


def test_keep_only_leaves_the_other_weights_grad_alone():
    a, b = _weights(2, 2)
    main = MainGrads([(a,), (b,)])
    main.keep_only([a])
    main.start()
    assert a.grad is main.buffers[0] and b.grad is None


@pytest.mark.parametrize("autocast", [False, True])
def test_a_linear_whose_weight_has_a_main_grad_adds_its_weight_gradient_into_it(autocast):
    torch.manual_seed(0)
    w, u = _weights(4, 2)
    x = torch.randn(5, 3, requires_grad=True)
    main = MainGrads([(w, u)])
    main.start()
    main.flat.fill_(1.0)  # gradients are added, not written
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), main.open():
        y, z = linears(x, [w, u], [None, None])
        out = (y.float().sum() + 2 * z.float().sum()) + linear(x, w).float().sum()
    out.backward()
    xs = x.detach().to(torch.bfloat16 if autocast else torch.float32).float()
    expected_w = 1.0 + 2 * xs.sum(0).expand(4, 3)  # from y and from linear(x, w)
    expected_u = 1.0 + 2 * xs.sum(0).expand(2, 3)
    assert w.grad is main.buffers[0] and u.grad is main.buffers[1]
    torch.testing.assert_close(w.grad, expected_w)
    torch.testing.assert_close(u.grad, expected_u)
