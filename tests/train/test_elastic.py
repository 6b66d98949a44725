"""Elastic resume under torchrun: a worker SIGKILLed mid-run or mid-save restarts the job, which
resumes from `latest` and ends with the loss of an uninterrupted run. (SIGTERM's save and clean exit:
test_run_summary.py, beside the summary that run prints.)"""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.train.common import write_corpus
from tests.train.elastic import TINY_GPT, last_loss_by_step, torchrun

STEPS = 8
FAULTS = ["kill_at_step:5", "kill_in_save:6"]
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
def launches(run_dir, corpus):
    """{run name: future of its torchrun}: the uninterrupted run and one run per fault, started side by
    side. Each is mostly process start-up and restarts, which leave cores idle, so the three together
    take less than one after another; each test awaits the runs it checks."""
    with ThreadPoolExecutor(max_workers=1 + len(FAULTS)) as pool:
        futures = {"clean": pool.submit(torchrun, 2, _args(run_dir, "clean", corpus, "--tp=2"))}
        for fault in FAULTS:
            futures[_name(fault)] = pool.submit(torchrun, 2, _args(run_dir, _name(fault), corpus, "--tp=2"),
                                                max_restarts=1, fault=fault)
        yield futures


def _name(fault):
    return fault.replace(":", "_")


@pytest.fixture(scope="module")
def uninterrupted(run_dir, launches):
    launches["clean"].result()
    return last_loss_by_step(f"{run_dir}/clean")


@pytest.mark.parametrize("fault", FAULTS)
def test_killed_worker_restarts_and_ends_with_the_uninterrupted_loss(run_dir, launches, uninterrupted, fault):
    name = _name(fault)
    proc = launches[name].result()
    assert "SIGKILL" in proc.stdout + proc.stderr, "the fault never fired"
    got = last_loss_by_step(f"{run_dir}/{name}")
    assert set(got) == set(range(1, STEPS + 1))
    assert got[STEPS] == pytest.approx(uninterrupted[STEPS], rel=1e-6, abs=1e-6)
    assert os.path.basename(open(f"{run_dir}/{name}/ckpt/latest").read().strip()) == f"step_{STEPS}"
