"""Elastic resume under torchrun: a worker SIGKILLed mid-run or mid-save restarts the job, which
resumes from `latest` and ends with the loss of an uninterrupted run. Also: SIGTERM saves and exits."""
import os
import signal
import subprocess
import sys

import pytest

from tests.train.common import write_corpus
from tests.train.elastic import ROOT, TINY_GPT, env, last_loss_by_step, torchrun

STEPS = 8
pytestmark = pytest.mark.slow


def _args(tmp, name, corpus, *extra):
    return [f"--data.path={corpus}", f"--checkpoint.dir={tmp}/{name}/ckpt", f"--log.dir={tmp}/{name}",
            f"--train.steps={STEPS}", "--checkpoint.interval=3", *TINY_GPT, *extra]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("elastic")


@pytest.fixture(scope="module")
def corpus(run_dir):
    return write_corpus(str(run_dir))


@pytest.fixture(scope="module")
def uninterrupted(run_dir, corpus):
    torchrun(2, _args(run_dir, "clean", corpus, "--tp=2"))
    return last_loss_by_step(f"{run_dir}/clean")


@pytest.mark.parametrize("fault", ["kill_at_step:5", "kill_in_save:6"])
def test_killed_worker_restarts_and_ends_with_the_uninterrupted_loss(run_dir, corpus, uninterrupted, fault):
    name = fault.replace(":", "_")
    proc = torchrun(2, _args(run_dir, name, corpus, "--tp=2"), max_restarts=1, fault=fault)
    assert "SIGKILL" in proc.stdout + proc.stderr, "the fault never fired"
    got = last_loss_by_step(f"{run_dir}/{name}")
    assert set(got) == set(range(1, STEPS + 1))
    assert got[STEPS] == pytest.approx(uninterrupted[STEPS], rel=1e-6, abs=1e-6)
    assert os.path.basename(open(f"{run_dir}/{name}/ckpt/latest").read().strip()) == f"step_{STEPS}"


def test_sigterm_saves_the_current_step_and_exits_cleanly(run_dir, corpus):
    ckpt = f"{run_dir}/term/ckpt"
    cmd = [sys.executable, "-m", "tpflash.train", f"--data.path={corpus}", f"--checkpoint.dir={ckpt}",
           f"--log.dir={run_dir}/term", "--train.steps=100000", *TINY_GPT]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # wait until training runs
        if line.startswith("[train] step 3 "):
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, rest
    assert "SIGTERM: saving step" in rest
    saved = open(os.path.join(ckpt, "latest")).read().strip()
    assert int(saved.split("_")[1]) >= 3
