"""tpflash.parallel.init: the (dp, cp, tp) mesh from the torchrun environment, and its errors."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import tpflash
from tests.distributed.checks import init_layout
from tpflash.parallel import NO_GROUP, check_layout, get_default_state, resolve_cp_group, set_default_state
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


@pytest.mark.parametrize("world, tp, dp, cp, message", [
    (6, 2, -1, 2, r"world size 6 is not divisible by tp=2 \* cp=2 = 4"),
    (4, 2, -1, 0, r"cp=0 must be an integer >= 1"),
    (4, 2, -1, 1.5, r"cp=1.5 must be an integer >= 1"),
    (4, 2, 2, 2, r"dp=2 \* cp=2 \* tp=2 = 8 does not equal the world size 4"),
])
def test_bad_cp_layouts_raise_naming_the_numbers(world, tp, dp, cp, message):
    with pytest.raises(ValueError, match=message):
        check_layout(world, tp, dp, cp)


def test_dp_is_inferred_from_world_tp_and_cp():
    assert check_layout(8, 2, -1, cp=2) == 2
    assert check_layout(8, 1, -1, cp=4) == 2


def layout_body(tp):
    ps = tpflash.parallel.init(tp=tp)
    world = dist.get_world_size()
    assert (ps.tp_size, ps.dp_size) == (tp, world // tp)
    assert ps.tp_rank == dist.get_rank() % tp and ps.dp_rank == dist.get_rank() // tp, "tp must be innermost"
    assert dist.get_world_size(ps.tp_group) == tp and dist.get_world_size(ps.dp_group) == world // tp
    assert get_default_state() is ps
    return ps.tp_rank, ps.dp_rank


def cp_layout_body(tp, cp, dp):
    ps = init_layout(tp, cp, dp)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (ps.tp_size, ps.cp_size, ps.dp_size, ps.world_size) == (tp, cp, world // (tp * cp), world)
    assert (ps.tp_rank, ps.cp_rank, ps.dp_rank) == (rank % tp, (rank // tp) % cp, rank // (tp * cp))
    sizes = [dist.get_world_size(g) for g in (ps.tp_group, ps.cp_group, ps.dp_group, ps.dp_cp_group)]
    assert sizes == [tp, cp, ps.dp_size, ps.dp_size * cp] and ps.dp_cp_size == ps.dp_size * cp
    assert ps.dp_cp_mesh.get_group() is ps.dp_cp_group and ps.cp_mesh.get_group() is ps.cp_group
    assert ps.dp_cp_rank == ps.dp_cp_mesh.get_local_rank() == ps.dp_rank * cp + ps.cp_rank
    assert sorted(dist.get_process_group_ranks(ps.dp_cp_group)) == [r for r in range(world) if r % tp == ps.tp_rank]
    assert sorted(dist.get_process_group_ranks(ps.cp_group)) == [
        r for r in range(world) if r % tp == ps.tp_rank and r // (tp * cp) == ps.dp_rank]
    assert f"cp={ps.cp_rank}/{cp}" in repr(ps)
    return ps.tp_rank, ps.cp_rank, ps.dp_rank


def cp_one_body():
    """At cp=1 the dp * cp mesh and group are the dp ones, and layers see no cp group."""
    ps = tpflash.parallel.init(tp=2)
    assert ps.cp_size == 1 and ps.dp_cp_mesh == ps.dp_mesh
    assert ps.dp_cp_group is ps.dp_group and (ps.dp_cp_size, ps.dp_cp_rank) == (ps.dp_size, ps.dp_rank)
    assert resolve_cp_group(None) is None


def resolve_cp_body():
    ps = init_layout(1, 2)
    assert resolve_cp_group(None) is ps.cp_group, "default: the state's cp group"
    assert resolve_cp_group(NO_GROUP) is None, "NO_GROUP means no context parallelism"
    assert resolve_cp_group(ps.dp_group) is ps.dp_group, "an explicit group wins"
    set_default_state(None)
    assert resolve_cp_group(None) is None, "no default state means no context parallelism"


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


@pytest.mark.parametrize("tp, cp, dp", [(2, 2, -1), (1, 2, 2)], ids=["tp2-cp2", "tp1-cp2-dp2"])
def test_init_builds_dp_cp_tp_mesh_with_tp_innermost_then_cp(ranks, tp, cp, dp):
    results = ranks(4).run(cp_layout_body, tp, cp, dp)
    assert results == [(r % tp, (r // tp) % cp, r // (tp * cp)) for r in range(4)]


def test_at_cp_1_the_dp_cp_mesh_and_group_are_the_dp_ones(ranks):
    ranks(4).run(cp_one_body)


def test_resolve_cp_group_follows_the_default_state_unless_given(ranks):
    ranks(2).run(resolve_cp_body)


def bad_cp_init_body():
    with pytest.raises(ValueError, match=r"world size 4 is not divisible by tp=2 \* cp=3 = 6"):
        tpflash.parallel.init(tp=2, cp=3)


def test_init_rejects_tp_times_cp_not_dividing_world_on_every_rank_without_hanging(ranks):
    ranks(4).run(bad_cp_init_body)


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
