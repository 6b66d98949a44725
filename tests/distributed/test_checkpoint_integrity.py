"""Damaged, missing and half-written checkpoints on 2 tp ranks: a clear error on every rank, no hang;
a crash mid-save keeps the previous checkpoint; an async save stages what it saves."""
import os

import pytest
import torch

import tpflash
from tests.checkpoint.tiny_model import assert_loads_back, build, full_state, make_optimizer, train
from tests.distributed.checks import init_tp
from tpflash.checkpoint import CheckpointCorruptError, directory

pytestmark = pytest.mark.cpu_ranks  # the tiny models live on CPU


def _trained(tp, steps):
    ps = init_tp(tp)
    model = build(seed=0)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(steps), ps.dp_rank, ps.dp_size)
    return model, optimizer


def save_body(root):
    model, optimizer = _trained(2, 1)
    tpflash.checkpoint.save(root, model, optimizer, step=1)


def load_error_body(root):
    """The CheckpointCorruptError message this rank gets (any other outcome fails the test)."""
    init_tp(2)
    model = build(seed=1)
    try:
        tpflash.checkpoint.load(root, model, make_optimizer(model))
    except CheckpointCorruptError as e:
        return str(e)
    raise AssertionError("loading a damaged checkpoint succeeded")


def _saved(ranks, tmp_path) -> str:
    root = str(tmp_path / "run")
    ranks(2).run(save_body, root)
    return os.path.join(root, "step_1")


def test_corrupted_shard_file_fails_load_on_every_rank_naming_it(ranks, tmp_path):
    path = _saved(ranks, tmp_path)
    shard = os.path.join(path, "__1_0.distcp")
    with open(shard, "r+b") as f:  # flip one byte in the middle, keeping the size
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    for message in ranks(2).run(load_error_body, path):
        assert "is corrupt" in message and "__1_0.distcp" in message and "checksum" in message, message


def test_missing_shard_file_fails_load_on_every_rank_naming_it(ranks, tmp_path):
    path = _saved(ranks, tmp_path)
    os.remove(os.path.join(path, "__0_0.distcp"))
    for message in ranks(2).run(load_error_body, os.path.dirname(path)):
        assert "is corrupt" in message and "__0_0.distcp is missing" in message, message


def _tmps(root, step):
    return [n for n in os.listdir(root) if n.startswith(f"{directory.TMP_PREFIX}step_{step}-")]


def crash_body(root):
    model, optimizer = _trained(2, 1)
    tpflash.checkpoint.save(root, model, optimizer, step=1)
    before = full_state(model, optimizer)
    train(model, optimizer, range(1, 2))

    def crash(*args, **kwargs):
        raise OSError("simulated crash between writing and committing")

    commit, directory.commit = directory.commit, crash
    try:
        tpflash.checkpoint.save(root, model, optimizer, step=2)
        raise AssertionError("the crashing save returned")
    except (OSError, RuntimeError) as e:
        assert "simulated crash" in str(e), e
    finally:
        directory.commit = commit
    assert tpflash.checkpoint.latest(root) == os.path.join(root, "step_1")
    assert len(_tmps(root, 2)) == 1 and not os.path.exists(os.path.join(root, "step_2"))
    fresh = build(seed=1)
    fresh_optimizer = make_optimizer(fresh)
    assert tpflash.checkpoint.load(root, fresh, fresh_optimizer)["step"] == 1
    after = full_state(fresh, fresh_optimizer)
    assert all(torch.equal(after[k], v) for k, v in before.items()), "previous checkpoint did not load intact"
    tpflash.checkpoint.save(root, model, optimizer, step=2)  # the next save removes this process's failed temp
    assert tpflash.checkpoint.latest(root) == os.path.join(root, "step_2")
    assert _tmps(root, 2) == []


def test_crash_mid_save_keeps_previous_checkpoint_loadable(ranks, tmp_path):
    ranks(2).run(crash_body, str(tmp_path / "run"))


def async_body(root):
    model, optimizer = _trained(2, 1)
    before = full_state(model, optimizer)
    pending = tpflash.checkpoint.save(root, model, optimizer, step=1, async_save=True)
    train(model, optimizer, range(1, 3))  # training (and its collectives) goes on during the write
    assert pending.wait() == os.path.join(root, "step_1")
    assert_loads_back(root, before)  # the state at the call, not after the training that went on


def test_async_save_writes_the_state_staged_at_the_call(ranks, tmp_path):
    ranks(2).run(async_body, str(tmp_path / "run"))
