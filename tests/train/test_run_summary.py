"""What a run says about itself: warnings at start (no checkpoint.dir, warmup longer than the run),
tokens/s both for the job and per GPU, and the end-of-run summary line, also after SIGTERM, which saves
the current step and exits 0."""
import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.train.common import tiny_config
from tests.train.elastic import ROOT, TINY_GPT, env
from tests.train.test_metrics import FakeClock
from tpflash.train import metrics


def test_no_checkpoint_dir_and_a_long_warmup_warn(tmp_path):
    cfg = tiny_config("x", train={"steps": 6, "warmup_steps": 12, "lr": 1e-2})
    assert metrics.start_warnings(cfg) == [
        metrics.NO_CHECKPOINT_DIR,
        "train.warmup_steps=12 > train.steps=6: the run never reaches train.lr=0.01 (its last step uses 0.005); "
        "lower train.warmup_steps"]
    assert metrics.end_warnings(cfg) == [metrics.NO_CHECKPOINT_DIR]
    assert "set --checkpoint.dir=" in metrics.NO_CHECKPOINT_DIR


def test_a_saved_run_with_a_short_warmup_has_no_warning():
    cfg = tiny_config("x", checkpoint={"dir": "runs/x/ckpt"}, train={"steps": 6, "warmup_steps": 6})
    assert metrics.start_warnings(cfg) == [] and metrics.end_warnings(cfg) == []


def test_totals_cover_the_whole_run_and_the_summary_names_where_things_are(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    meter = metrics.Throughput(flops_per_token=6.0, peak=100.0, world=2)
    meter.add(1000)
    clock.now += 1.0
    meter.read()
    with meter.paused():
        clock.now += 5.0  # a save: in the wall time, not the training time
    meter.add(3000)
    clock.now += 1.0  # not read yet: counted all the same
    totals = meter.totals()
    assert totals["tokens"] == 4000 and totals["train_s"] == 2.0
    assert totals["tokens_per_s"] == 2000.0 and totals["tokens_per_s_per_gpu"] == 1000.0
    cfg = tiny_config("x", checkpoint={"dir": "runs/x/ckpt"}, log={"dir": "runs/x"})
    record, text = metrics.run_summary(cfg, meter, first_step=4, step=10, saved_step=10,
                                       last={"loss": 2.5, "eval_loss": 2.75}, device=torch.device("cpu"))
    assert record["steps"] == 6 and record["tokens"] == 4000 and record["time_s"] == 7.0
    assert record["mfu"] == 2000.0 * 6.0 / 200.0 and record["eval_loss"] == 2.75
    assert text.startswith("run summary: steps 5-10 (6 steps), 4000 tokens in 7 s (2 s training), "
                           "1000 tokens/s per GPU x 2, mfu 60, peak rss_gb "), text
    assert text.endswith("loss 2.5 eval_loss 2.75; checkpoints: runs/x/ckpt (newest step 10); "
                         "metrics: runs/x/metrics.jsonl"), text


def _write_corpus(directory):
    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(200)))
    return corpus


def _run_without_checkpoint_dir(directory):
    """A 3-step run with no checkpoint.dir and a warmup longer than the run: (its result, its log.dir)."""
    cmd = [sys.executable, "-m", "tpflash.train", f"--data.path={_write_corpus(directory)}", f"--log.dir={directory}",
           *TINY_GPT, "--train.steps=3", "--train.warmup_steps=10", "--log.tensorboard=off"]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120), directory


def _run_stopped_by_sigterm(directory):
    """A long run with a checkpoint.dir, SIGTERMed once step 3 is logged: (exit status, what it printed
    after the signal, its checkpoint.dir)."""
    ckpt = os.path.join(directory, "ckpt")
    cmd = [sys.executable, "-m", "tpflash.train", f"--data.path={_write_corpus(directory)}", f"--checkpoint.dir={ckpt}",
           *TINY_GPT, "--train.steps=100000", "--train.warmup_steps=2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # wait until training runs
            if line.startswith("[train] step 3 "):
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()  # no-op once it has exited
    return proc.returncode, rest, ckpt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: future of its result}: the two trainer runs the tests below read, started together (each is
    one process, mostly start-up on one core)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {"no checkpoint.dir": pool.submit(_run_without_checkpoint_dir, str(tmp_path_factory.mktemp("plain"))),
               "sigterm": pool.submit(_run_stopped_by_sigterm, str(tmp_path_factory.mktemp("sigterm")))}


def test_a_run_without_checkpoint_dir_warns_at_start_and_end_and_ends_with_a_summary(runs):
    proc, log_dir = runs["no checkpoint.dir"].result()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warning = f"WARNING: {metrics.NO_CHECKPOINT_DIR}"
    assert proc.stderr.count(warning) == 2, proc.stderr  # at start and at the end
    assert "WARNING: train.warmup_steps=10 > train.steps=3" in proc.stderr, proc.stderr
    summary = [line for line in proc.stdout.splitlines() if line.startswith("run summary: ")]
    assert len(summary) == 1 and "steps 1-3 (3 steps)" in summary[0], proc.stdout
    assert "checkpoints: none (no checkpoint.dir)" in summary[0] and "eval_loss" in summary[0], summary
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train = [r for r in rows if r["kind"] == "train"]
    assert all(r["tokens_per_s_per_gpu"] == r["tokens_per_s"] for r in train)  # one process: one device
    (record,) = [r for r in rows if r["kind"] == "summary"]
    assert record["steps"] == 3 and record["tokens"] == 3 * 4 * 16 and record["loss"] == train[-1]["loss"]


def test_sigterm_saves_the_current_step_and_exits_cleanly(runs):
    returncode, rest, ckpt = runs["sigterm"].result()
    assert returncode == 0, rest
    assert "SIGTERM: saving step" in rest
    saved = open(os.path.join(ckpt, "latest")).read().strip()
    assert int(saved.split("_")[1]) >= 3


def test_a_run_stopped_by_sigterm_ends_with_its_summary(runs):
    returncode, rest, ckpt = runs["sigterm"].result()
    assert returncode == 0, rest
    (summary,) = [line for line in rest.splitlines() if line.startswith("run summary: ")]
    saved = int(open(os.path.join(ckpt, "latest")).read().strip().rsplit("_", 1)[1])
    assert f"checkpoints: {ckpt} (newest step {saved})" in summary and f"steps 1-{saved} " in summary, summary
    assert "WARNING" not in rest  # a checkpoint.dir and a short warmup: nothing to warn about
