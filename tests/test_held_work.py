"""HeldWork (tpflash.parallel.held_work): work is run in the order held; weight gradients may be held only
inside holding_gradients, which runs whatever is left when it ends, or drops it if the block fails."""
import pytest
import torch

from tpflash.parallel.held_work import HeldWork, holding_gradients


def test_held_work_runs_in_the_order_held_and_only_once():
    held, ran = HeldWork(), []
    held.hold(lambda: ran.append("up"))
    held.hold(lambda: ran.append("gate"))
    held.run()
    held.run()
    assert ran == ["up", "gate"] and held.pending == []


def test_gradients_may_be_held_only_inside_holding_gradients():
    held = HeldWork()
    assert not held.holds_gradients
    with holding_gradients([held]):
        assert held.holds_gradients
    assert not held.holds_gradients


def test_what_is_still_held_when_holding_ends_runs_then():
    held, ran = HeldWork(), []
    with holding_gradients([held]):
        held.hold(lambda: ran.append(1))
    assert ran == [1] and held.pending == []


def test_a_failing_holding_block_drops_what_it_held_without_running_it():
    held, ran = HeldWork(), []
    with pytest.raises(RuntimeError, match="boom"):
        with holding_gradients([held]):
            held.hold(lambda: ran.append(1))
            raise RuntimeError("boom")
    assert ran == [] and held.pending == [] and not held.holds_gradients


def test_held_weight_gradients_of_one_shape_run_as_one_batch_in_the_place_of_the_first(monkeypatch):
    from tpflash.parallel import held_work as module
    batches, ran = [], []
    real = module.weight_grads_fp32
    def spy(grads, xs, **kw):
        batches.append(len(grads))
        ran.append("batch")
        return real(grads, xs, **kw)
    monkeypatch.setattr(module, "weight_grads_fp32", spy)
    torch.manual_seed(0)
    square = [(torch.randn(6, 4), torch.randn(6, 4)) for _ in range(2)]
    other = (torch.randn(6, 3), torch.randn(6, 4))
    into = [torch.randn(4, 4), torch.randn(4, 4), torch.randn(3, 4)]
    want = [into[0] + square[0][0].t() @ square[0][1], into[1] + square[1][0].t() @ square[1][1],
            into[2] + other[0].t() @ other[1]]
    held = HeldWork()
    held.hold(lambda: ran.append("cast"))
    held.hold_weight_grad(*square[0], into=into[0])
    held.hold(lambda: ran.append("later"))
    held.hold_weight_grad(*other, into=into[2])
    held.hold_weight_grad(*square[1], into=into[1])
    held.run()
    assert ran == ["cast", "batch", "later", "batch"] and batches == [2, 1], (ran, batches)
    for got, expected in zip(into, want):
        torch.testing.assert_close(got, expected)


def test_a_held_gradient_that_is_added_is_not_batched_with_one_that_is_written():
    grad_y, x = torch.randn(6, 4), torch.randn(6, 4)
    held, added, written = HeldWork(), torch.ones(4, 4), torch.full((4, 4), float("nan"))
    held.hold_weight_grad(grad_y, x, into=added)
    held.hold_weight_grad(grad_y, x, out=written)
    held.run()
    torch.testing.assert_close(added, 1 + grad_y.t() @ x)
    torch.testing.assert_close(written, grad_y.t() @ x)
