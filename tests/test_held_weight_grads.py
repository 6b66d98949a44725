"""HeldWeightGrads (tpflash.parallel.held_weight_grads): GEMMs are held only while holding is on, run
in the order held, and whatever is left runs when the holding block ends, or is dropped if it fails."""
import pytest

from tpflash.parallel.held_weight_grads import HeldWeightGrads, holding


def test_nothing_is_held_while_holding_is_off():
    held, ran = HeldWeightGrads(), []
    assert not held.hold(lambda: ran.append(1))
    assert held.pending == [] and ran == []


def test_held_gemms_run_in_the_order_held():
    held, ran = HeldWeightGrads(), []
    with holding([held]):
        held.hold(lambda: ran.append("up"))
        held.hold(lambda: ran.append("gate"))
        held.run()
        assert ran == ["up", "gate"] and held.pending == []


def test_what_is_still_held_when_holding_ends_runs_then():
    held, ran = HeldWeightGrads(), []
    with holding([held]):
        held.hold(lambda: ran.append(1))
    assert ran == [1] and not held.enabled and held.pending == []


def test_a_failing_holding_block_drops_what_it_held_without_running_it():
    held, ran = HeldWeightGrads(), []
    with pytest.raises(RuntimeError, match="boom"):
        with holding([held]):
            held.hold(lambda: ran.append(1))
            raise RuntimeError("boom")
    assert ran == [] and held.pending == [] and not held.enabled
