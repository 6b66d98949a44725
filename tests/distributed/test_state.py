"""tpflash.parallel.init: the (dp, tp) mesh from the torchrun environment, and its errors."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import tpflash
from tpflash.parallel import NO_GROUP, check_layout, get_default_state, set_default_state
from tpflash.layers import ColumnParallelLinear


@pytest.mark.parametrize("world, tp, dp, message", [
    (4, 3, -1, r"world size 4 is not divisible by tp=3"),
    (4, 0, -1, r"tp=0 must be an integer >= 1"),
    (4, 2, 3, r"dp=3 \* tp=2 = 6 does not equal the world size 4"),
    (4, 2, 0, r"dp=0 must be -1 \(infer\) or an integer >= 1"),
])
def test_bad_layouts_raise_naming_the_numbers(world, tp, dp, message):
    with pytest.raises(ValueError, match=message):
        check_layout(world, tp, dp)


def test_dp_is_inferred_from_world_and_tp():
    assert check_layout(8, 2, -1) == 4


def layout_body(tp):
    ps = tpflash.parallel.init(tp=tp)
    world = dist.get_world_size()
    assert (ps.tp_size, ps.dp_size) == (tp, world // tp)
    assert ps.tp_rank == dist.get_rank() % tp and ps.dp_rank == dist.get_rank() // tp, "tp must be innermost"
    assert dist.get_world_size(ps.tp_group) == tp and dist.get_world_size(ps.dp_group) == world // tp
    assert get_default_state() is ps
    return ps.tp_rank, ps.dp_rank


def bad_init_body(tp):
    with pytest.raises(ValueError, match=rf"world size 4 is not divisible by tp={tp}"):
        tpflash.parallel.init(tp=tp)


def explicit_group_body():
    """A layer given process_group= uses it, whatever the default state says."""
    tpflash.parallel.init(tp=4)
    pair, _ = dist.new_subgroups(group_size=2)
    assert ColumnParallelLinear(4, 8).weight.shape == (2, 4), "default: the tp=4 group"
    assert ColumnParallelLinear(4, 8, process_group=pair).weight.shape == (4, 4), "explicit group wins"
    assert ColumnParallelLinear(4, 8, process_group=NO_GROUP).weight.shape == (8, 4), "NO_GROUP means tp=1"
    set_default_state(None)
    assert ColumnParallelLinear(4, 8).weight.shape == (8, 4), "no default state means tp=1"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_init_builds_dp_by_tp_mesh_with_tp_innermost(ranks, tp):
    results = ranks(4).run(layout_body, tp)
    assert results == [(r % tp, r // tp) for r in range(4)]


def test_init_rejects_tp_not_dividing_world_on_every_rank_without_hanging(ranks):
    ranks(4).run(bad_init_body, 3)


def test_explicit_process_group_overrides_the_default_state(ranks):
    ranks(4).run(explicit_group_body)


def test_shutdown_destroys_the_groups_and_clears_the_default_state():
    # in a process of its own: the test process's pools keep their groups
    script = ("import torch.distributed as dist; from tpflash import parallel; parallel.init(tp=1); "
              "assert parallel.get_default_state() is not None; parallel.shutdown(); "
              "assert not dist.is_initialized() and parallel.get_default_state() is None; print('clean')")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-2000:]
