"""Hangs name themselves: a rank stopped with SIGSTOP (alive but silent) fails the job within dist.timeout with
one line naming it, the operation, the group and the step; under --max-restarts the job resumes from its
last checkpoint and finishes. Also the watch's own rules, without processes."""
import os
import re
import signal
import time

import pytest
import torch.distributed as dist

from tests.train.common import write_corpus
from tests.train.elastic import TINY_GPT, launch, last_loss_by_step
from tpflash.train import watchdog
from tpflash.train.config import TrainConfig, check_values, parse_args

TIMEOUT = 4  # dist.timeout of the end-to-end runs, seconds
MARGIN = 25  # from the stall to torchrun's exit, beyond TIMEOUT: generous (a loaded CI machine)
LINE = re.compile(r"^error: timed out: rank 1 did not arrive \(silent .*\); rank 0 waited [\d.]+ s "
                  rf"\(dist.timeout {TIMEOUT} s\) in all_reduce #\d+ over tp \(ranks 0-1\) in the forward of step 3; "
                  r"flight recorder dumps: .*flight_recorder/rank_<rank>$", re.M)
STALL = re.compile(r"stall_at_step:3: SIGSTOP pid (\d+) at ([\d.]+)")


def _stalled_run(tmp, max_restarts):
    corpus = write_corpus(str(tmp))
    args = [f"--data.path={corpus}", f"--checkpoint.dir={tmp}/ckpt", f"--log.dir={tmp}", "--train.steps=6",
            "--checkpoint.interval=2", "--tp=2", f"--dist.timeout={TIMEOUT}", *TINY_GPT]
    proc = launch(2, args, max_restarts=max_restarts, fault="stall_at_step:3")
    end = time.time()
    stall = STALL.search(proc.stdout)
    if stall:  # the watch SIGKILLs it; should it not have, the test leaves no stopped process behind
        try:
            os.kill(int(stall.group(1)), signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert stall, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, end - float(stall.group(2))


@pytest.mark.slow
def test_a_stopped_rank_fails_the_job_within_the_timeout_with_one_line_naming_it(tmp_path):
    proc, elapsed = _stalled_run(tmp_path, max_restarts=0)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert len(LINE.findall(proc.stderr)) == 1 and out.count("error: ") == 1, out[-3000:]
    assert f"exitcode  : {watchdog.TIMEOUT_STATUS}" in out, out[-3000:]  # torchrun's summary of rank 0
    assert elapsed < TIMEOUT + MARGIN, f"{elapsed:.1f} s from the stall to the job's end\n{out[-3000:]}"
    assert os.path.getsize(tmp_path / "flight_recorder" / "rank_0") > 0


@pytest.mark.slow
def test_under_max_restarts_the_job_resumes_from_its_last_checkpoint_and_finishes(tmp_path):
    proc, _ = _stalled_run(tmp_path, max_restarts=1)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert len(LINE.findall(proc.stderr)) == 1, out[-3000:]
    assert f"resumed from {tmp_path}/ckpt at step 2" in proc.stdout, out[-3000:]
    assert set(last_loss_by_step(str(tmp_path))) == set(range(1, 7))
    assert open(tmp_path / "ckpt" / "latest").read().strip().endswith("step_6")


def test_the_timeouts_are_config_keys_with_one_line_errors():
    cfg = TrainConfig()
    assert (cfg.dist.timeout, cfg.dist.long) == (600.0, 1800.0)
    assert parse_args(["--dist.timeout=60", "--dist.long_timeout=300"]).dist.long == 300.0
    with pytest.raises(ValueError, match=re.escape("'dist.timeout': 0.0 must be > 0")):
        parse_args(["--dist.timeout=0"])
    cfg = parse_args(["--dist.timeout=60", "--dist.long_timeout=30"])
    with pytest.raises(ValueError, match=re.escape("'dist.long_timeout': 30.0 must be 0 (3 x dist.timeout) or >= "
                                                   "dist.timeout (60.0)")):
        check_values(cfg)


def test_the_run_s_first_step_and_its_saves_get_the_long_timeout():
    watch = watchdog.HangWatch(5, 15, {}, "/tmp/x_")
    long = []
    for step, phase in [(1, "forward"), (1, "vote"), (2, "forward"), (2, "save"), (3, "backward"), (3, "eval")]:
        watch.begin_step(step)
        watch.enter(phase)
        long.append(watch._long)
    assert long == [True, True, False, True, False, True]
    assert watchdog.group_timeout(15, 5) > 15 + 3 * watchdog.beat_interval(5)  # the groups' backstop fires later


class _Beating:
    """Heartbeats in a HashStore, and a sleep during which the given ranks beat again."""

    def __init__(self, beats, alive):
        self.store, self.alive, self.beats = dist.HashStore(), alive, beats
        for r, b in beats.items():
            self.store.set(f"beat/{r}", b)

    def sleep(self, seconds):
        for r in self.alive:
            count, rest = self.beats[r].split(" ", 1)
            self.store.set(f"beat/{r}", f"{int(count) + 1} {rest}")


def _missing(monkeypatch, beats, alive):
    fake = _Beating(beats, alive)
    monkeypatch.setattr(watchdog.time, "sleep", fake.sleep)
    watch = watchdog.HangWatch(5, 15, {}, "/tmp/x_")
    watch.world, watch.rank = len(beats), 0
    return watch._missing(fake.store, 1.0)


def test_silent_ranks_are_the_ones_named(monkeypatch):
    beats = {0: "4 3 20 forward 1 here", 1: "3 2 17 vote 2 elsewhere", 2: "4 3 20 forward 3 elsewhere"}
    assert _missing(monkeypatch, beats, alive=[0, 2]) == (
        "rank 1 did not arrive (silent for 1.0 s: stopped, or a stuck host; rank 1's last heartbeat at step 2, "
        "the stop vote)")


def test_without_silent_ranks_those_behind_are_named(monkeypatch):
    beats = {0: "4 3 20 forward 1 h", 1: "4 3 21 backward 2 h", 2: "4 3 20 forward 3 h", 3: "4 3 21 backward 4 h"}
    text = _missing(monkeypatch, beats, alive=[0, 1, 2, 3])
    assert text == "ranks 0, 2 did not arrive (alive, behind the others: rank 0 at step 3, the forward; " \
                   "rank 2 at step 3, the forward)"
    beats = {0: "4 3 20 forward 1 h", 1: "4 3 20 forward 2 h"}
    assert _missing(monkeypatch, beats, alive=[0, 1]).startswith("no rank is behind on the host")


def test_rank_lists():
    assert [watchdog.rank_list(r) for r in ([1], [0, 1, 2, 3], [0, 2])] == ["rank 1", "ranks 0-3", "ranks 0, 2"]
