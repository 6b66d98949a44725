"""HeldWork (tpflash.parallel.held_work): work is run in the order held; weight gradients may be held only
inside holding_gradients, which runs whatever is left when it ends, or drops it if the block fails."""
import pytest

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
