"""HostStaging: the host buffers async saves copy the state into, reused from one save to the next."""
import os
import threading

import pytest
import torch

import tpflash
from tests.checkpoint.tiny_model import assert_loads_back, build, full_state, make_optimizer, train
from tests.distributed.checks import init_tp
from tpflash.checkpoint import HostStaging, PendingSave
from tpflash.checkpoint import staging as staging_module
from tpflash.checkpoint.layout import Chunk


def _state(device="cpu"):
    weight = torch.arange(12.0, device=device).reshape(3, 4)
    return {"w": Chunk(weight.t()[1:3], (1, 0), torch.Size((4, 3))),  # a strided piece of a live tensor
            "step": torch.tensor(7, device=device), "meta": b"bytes pass through"}, weight


def test_staged_tensors_are_host_copies_of_the_state_at_the_call():
    state, weight = _state()
    staged = HostStaging().stage(state)
    weight.zero_()  # training goes on after the call
    assert torch.equal(staged["w"].piece, torch.arange(12.0).reshape(3, 4).t()[1:3])
    assert staged["w"].offsets == (1, 0) and staged["w"].shape == (4, 3)
    assert staged["step"].item() == 7 and staged["meta"] == b"bytes pass through"


def test_a_second_save_reuses_the_buffers_and_a_new_shape_gets_a_new_one():
    staging = HostStaging()
    first = staging.stage(_state()[0])
    second = staging.stage(_state()[0])
    assert second["w"].piece.data_ptr() == first["w"].piece.data_ptr()
    third = staging.stage({"w": torch.zeros(5)})
    assert third["w"].data_ptr() != first["w"].piece.data_ptr() and third["w"].shape == (5,)


def test_buffers_reserved_ahead_are_the_ones_the_first_stage_copies_into():
    staging = HostStaging()
    state, weight = _state()
    staging.reserve(state)
    staging._wait_for_buffers()
    reserved = staging._buffers["w"].data_ptr()
    staged = staging.stage(state)
    assert staged["w"].piece.data_ptr() == reserved
    assert torch.equal(staged["w"].piece, weight.t()[1:3])


@pytest.mark.gpu
def test_on_cuda_reserved_buffers_are_pinned():
    staging = HostStaging()
    staging.reserve(_state("cuda")[0])
    staged = staging.stage(_state("cuda")[0])
    assert staged["w"].piece.is_pinned()


def test_staging_waits_until_the_previous_write_from_the_buffers_has_finished():
    staging = HostStaging()
    staging.stage(_state()[0])
    release = threading.Event()
    pending = PendingSave("step_1")
    pending.start(release.wait)
    staging.read_by(pending)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (staging.stage(_state()[0]), done.set()))
    thread.start()
    assert not done.wait(0.3), "staged over buffers a write was still reading"
    release.set()
    thread.join(10)
    assert done.is_set()


@pytest.mark.gpu
def test_on_cuda_the_buffers_are_pinned_and_hold_the_device_s_values():
    state, weight = _state("cuda")
    staged = HostStaging().stage(state)
    weight.zero_()
    piece = staged["w"].piece
    assert piece.is_pinned() and not piece.is_cuda
    assert torch.equal(piece, torch.arange(12.0).reshape(3, 4).t()[1:3])


def two_saves_body(root):
    ps = init_tp(2)
    model = build(seed=0)
    optimizer = make_optimizer(model)
    staging, snapshots = HostStaging(), {}
    for step in (1, 2):
        train(model, optimizer, range(step - 1, step), ps.dp_rank, ps.dp_size)
        snapshots[step] = full_state(model, optimizer)
        tpflash.checkpoint.save(root, model, optimizer, step=step, keep=0, async_save=True, staging=staging)
    train(model, optimizer, range(2, 3), ps.dp_rank, ps.dp_size)  # goes on while step 2 is written
    tpflash.checkpoint.wait_pending(root)
    for step, before in snapshots.items():
        assert_loads_back(os.path.join(root, f"step_{step}"), before)


@pytest.mark.cpu_ranks
def test_two_async_saves_through_one_staging_each_write_the_state_at_their_call(ranks, tmp_path):
    ranks(2).run(two_saves_body, str(tmp_path / "run"))


def test_reserving_without_a_staging_is_refused_naming_it():
    with pytest.raises(TypeError, match="staging=None must be a tpflash.checkpoint.HostStaging"):
        tpflash.checkpoint.reserve_staging(None, build(seed=0))


def test_a_node_has_room_when_its_ranks_copies_fit_in_half_of_its_available_memory():
    state = {"w": torch.zeros(1000), "meta": b"not counted"}  # 4,000 bytes
    assert staging_module.state_bytes(state) == 4000
    assert staging_module.fits_in_host_memory(state, local_ranks=4, available=32_000)
    assert not staging_module.fits_in_host_memory(state, local_ranks=4, available=31_999)
    assert not staging_module.fits_in_host_memory(state, local_ranks=1, available=None)


@pytest.mark.parametrize("available,reserved", [(10 ** 12, True), (1000, False), (None, False)])
def test_reserving_only_if_room_reserves_where_the_node_has_room_for_its_ranks_copies(monkeypatch, available,
                                                                                    reserved):
    import tpflash.checkpoint.api as api
    monkeypatch.setattr(api, "host_memory_available", lambda: available)
    staging = HostStaging()
    assert tpflash.checkpoint.reserve_staging(staging, build(seed=0), only_if_room=True) is reserved
    staging._wait_for_buffers()
    assert bool(staging._buffers) is reserved


def sync_staged_body(root):
    ps = init_tp(2)
    model = build(seed=0)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(1), ps.dp_rank, ps.dp_size)
    rank = torch.distributed.get_rank()
    before = full_state(model, optimizer)
    times = {}
    path = tpflash.checkpoint.save(root, model, optimizer, step=1, staging=HostStaging(pinned=False), times=times)
    assert "staging" in times and times["write"] > 0
    mine = [f for f in os.listdir(path) if f.startswith(f"__{rank}_") and f.endswith(".distcp")]
    assert len(mine) > 1, f"rank {rank} wrote {mine}: staged state goes through several writer threads"
    assert_loads_back(path, before)


@pytest.mark.cpu_ranks
def test_a_synchronous_save_through_a_staging_writes_from_several_threads_and_loads_back_exactly(ranks, tmp_path):
    ranks(2).run(sync_staged_body, str(tmp_path / "run"))
