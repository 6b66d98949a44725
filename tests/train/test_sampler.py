"""GlobalSampler: deterministic order, exact resume, and the same samples whatever dp is."""
import numpy as np
import pytest

from tpflash.train.sampler import GlobalSampler
from tpflash.train.schedule import lr_at


def _run(sampler, steps, batch, dp):
    """The samples each step reads, as {step: sorted indices over all dp ranks}."""
    seen = {}
    for _ in range(steps):
        step = sampler.consumed // batch
        seen[step] = np.concatenate([sampler.rank_slice(batch, d, dp) for d in range(dp)])
        sampler.advance(batch)
    return seen


def test_same_seed_same_order_and_epochs_are_permutations():
    a, b = GlobalSampler(10, seed=3), GlobalSampler(10, seed=3)
    assert np.array_equal(a.indices(0, 25), b.indices(0, 25))
    assert sorted(a.indices(0, 10)) == list(range(10)) and sorted(a.indices(10, 10)) == list(range(10))
    assert not np.array_equal(a.indices(0, 10), a.indices(10, 10))  # each epoch reshuffled


@pytest.mark.parametrize("dp_before, dp_after", [(2, 1), (1, 4), (4, 2)])
def test_resume_with_other_dp_reads_exactly_the_uninterrupted_samples(dp_before, dp_after):
    batch, n = 8, 37
    reference = _run(GlobalSampler(n, seed=1), 12, batch, dp=1)
    first = GlobalSampler(n, seed=1)
    got = _run(first, 5, batch, dp_before)
    resumed = GlobalSampler(n, seed=1)
    resumed.load_state_dict(first.state_dict())
    got.update(_run(resumed, 7, batch, dp_after))
    assert sorted(got) == sorted(reference)
    for step in reference:
        assert np.array_equal(got[step], reference[step]), f"step {step}: samples differ after resume"


def test_ranks_of_one_step_read_disjoint_slices():
    s = GlobalSampler(100, seed=0)
    parts = [s.rank_slice(12, d, 3) for d in range(3)]
    assert len(set(np.concatenate(parts).tolist())) == 12


def test_loading_state_of_other_data_is_refused():
    s = GlobalSampler(50, seed=0)
    with pytest.raises(ValueError, match="num_samples=40, seed=0 but this job has num_samples=50"):
        s.load_state_dict({"consumed_samples": 8, "seed": 0, "num_samples": 40})


def test_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 1.0, 0.1, warmup=4, decay=10) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(x >= y for x, y in zip(lrs[3:], lrs[4:])) and lrs[-1] == pytest.approx(0.1)
