"""SIGUSR1 makes a trainer worker print every thread's Python stack and carry on (for a job that seems stuck)."""
import signal
import subprocess
import sys

import pytest

from tests.train.common import write_corpus
from tests.train.elastic import ROOT, TINY_GPT, env


@pytest.mark.slow
def test_sigusr1_prints_every_thread_s_stack_and_training_goes_on(tmp_path):
    corpus = write_corpus(str(tmp_path))
    cmd = [sys.executable, "-m", "tpflash.train", f"--data.path={corpus}", "--train.steps=100000", *TINY_GPT]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # training runs
            if line.startswith("[train] step 2 "):
                break
        proc.send_signal(signal.SIGUSR1)
        for line in proc.stdout:  # and goes on after the signal
            if line.startswith("[train] step 40 "):
                break
        else:
            raise AssertionError("training stopped after SIGUSR1")
    finally:
        proc.terminate()  # SIGTERM: the trainer saves nothing (no checkpoint.dir) and exits
        _, err = proc.communicate(timeout=60)
    assert "Current thread" in err and 'File "' in err and "tpflash/train/loop.py" in err, err[-3000:]
