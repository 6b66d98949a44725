"""One job per checkpoint directory, with real trainers: a second job started on a running job's
checkpoint.dir is refused with one line naming the holder, and the first finishes intact."""
import os
import subprocess
import sys

import pytest

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.cpu_ranks


def _first_job_with_a_second_started_beside_it(corpus, ckpt):
    from tpflash import checkpoint
    from tpflash.train.loop import Trainer
    cfg = tiny_config(corpus, checkpoint={"dir": ckpt, "interval": 3})
    first = Trainer(cfg, TinyConfig, TinyLM)  # holds checkpoint.dir's lock from here
    second = subprocess.run(
        [sys.executable, "-m", "tpflash.train", f"--data.path={corpus}", "--data.seq_len=16", "--model.block_size=16",
         "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--train.steps=2", "--train.batch_size=2",
         "--train.lr=1e-2", "--train.min_lr=1e-3", "--train.warmup_steps=1", f"--checkpoint.dir={ckpt}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")})
    first.run()
    path = checkpoint.latest(ckpt)
    return second.returncode, second.stderr, os.path.basename(path) if path else None


def test_a_second_job_on_a_locked_directory_is_refused_and_the_first_finishes(ranks, tmp_path):
    corpus = write_corpus(str(tmp_path))
    ckpt = str(tmp_path / "ckpt")
    (code, stderr, newest), = ranks(1).run(_first_job_with_a_second_started_beside_it, corpus, ckpt)
    assert code != 0
    assert "in use by another job" in stderr and stderr.count("Traceback") == 0, stderr[-2000:]
    assert newest == "step_6"
