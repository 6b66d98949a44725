"""One job per checkpoint directory (lock.py), unique temps, the newest complete step wins over the
`latest` pointer, and extras are unpickled without running code."""
import multiprocessing
import os

import pytest
import torch

import tpflash
from tests.checkpoint.tiny_model import build, make_optimizer, train
from tpflash.checkpoint import CheckpointLockedError, UnsafeCheckpointError, directory, lock
from tpflash.checkpoint.blob import from_blob, to_blob


def _contend(root, start, tried, results):
    start.wait()
    held = None
    try:
        held = lock.acquire(root, heartbeat_s=60)
        results.put("won")
    except CheckpointLockedError as e:
        results.put(f"refused: {e}")
    finally:
        tried.wait(timeout=60)  # the winner holds the lock until both have tried, however late the other starts
        if held is not None:
            held.release()


def test_fifty_start_races_have_exactly_one_winner(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for i in range(50):
        root, start, tried, results = str(tmp_path / f"r{i}"), ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_contend, args=(root, start, tried, results)) for _ in range(2)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=20) for _ in procs)
        for p in procs:
            p.join(timeout=20)
            assert p.exitcode == 0
        assert outcomes[1] == "won" and outcomes[0].startswith("refused: checkpoint directory"), outcomes
        assert "is in use by another job (host" in outcomes[0]
        assert not os.path.exists(os.path.join(root, lock.LOCK_FILE)), "the winner released it"


def _hold(root, ready, done):
    lock.acquire(root)
    ready.set()
    done.wait(30)


def test_a_live_holder_is_named_and_a_dead_one_taken_over_with_its_temps(tmp_path):
    ctx = multiprocessing.get_context("fork")
    root, ready, done = str(tmp_path / "ck"), ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(root, ready, done))
    holder.start()
    assert ready.wait(20)
    with pytest.raises(CheckpointLockedError, match=f"pid {holder.pid}"):
        lock.acquire(root)
    os.makedirs(os.path.join(root, f".tmp-step_3-{os.uname().nodename}-{holder.pid}-0123abcd"))
    os.makedirs(os.path.join(root, ".tmp-step_4-otherhost-1-0123abcd"))  # a live writer elsewhere: kept
    holder.kill()  # dies holding the lock
    holder.join()
    warned = []
    held = lock.acquire(root, warn=warned.append)
    assert len(warned) == 1 and "took over the lock" in warned[0] and "process has exited" in warned[0]
    assert sorted(os.listdir(root)) == [".tmp-step_4-otherhost-1-0123abcd", lock.LOCK_FILE]
    held.release()
    assert not os.path.exists(os.path.join(root, lock.LOCK_FILE))


def test_resume_takes_the_newest_complete_step_not_the_pointer(tmp_path):
    model, root = build(seed=0), str(tmp_path)
    optimizer = make_optimizer(model)
    for step in (1, 2):
        train(model, optimizer, range(step - 1, step))
        tpflash.checkpoint.save(root, model, optimizer, step=step)
    assert [n for n in os.listdir(root) if n.startswith(directory.TMP_PREFIX)] == []
    with open(os.path.join(root, directory.LATEST), "w") as f:  # a crash before the pointer's update
        f.write("step_1\n")
    assert tpflash.checkpoint.resume_point(root) == os.path.join(root, "step_2")
    os.remove(os.path.join(root, directory.LATEST))
    assert tpflash.checkpoint.latest(root) == os.path.join(root, "step_2")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_callable_in_the_extras_is_refused_without_running(tmp_path):
    marker = str(tmp_path / "ran")
    blob = to_blob({"step": 1, "extras": {"evil": _Payload(marker)}})
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt/step_1: entry 'meta' holds a pickled \w+\.system"):
        from_blob(blob, "ckpt/step_1: entry 'meta'")
    assert not os.path.exists(marker)
    model = build(seed=0)  # and through load: the extras of a saved checkpoint
    optimizer = make_optimizer(model)
    tpflash.checkpoint.save(str(tmp_path / "ck"), model, optimizer, step=1, evil=_Payload(marker))
    with pytest.raises(UnsafeCheckpointError, match="step_1: entry 'meta'"):
        tpflash.checkpoint.load(str(tmp_path / "ck"), model, optimizer)
    assert not os.path.exists(marker)


def test_numpy_and_rng_values_load_safely():
    import numpy as np
    value = from_blob(to_blob({"a": np.arange(3), "x": np.float64(0.5), "rng": np.random.get_state(),
                               "t": torch.ones(2), "v": torch.__version__}))
    assert value["x"] == 0.5 and value["a"].tolist() == [0, 1, 2] and value["rng"][0] == "MT19937"
