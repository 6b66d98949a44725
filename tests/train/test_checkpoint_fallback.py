"""Resume rules in the trainer: a damaged newest step is skipped (or refused with on_corrupt=error),
and ranks that see different checkpoint directories fail together instead of hanging."""
import os

import pytest
import torch.distributed as dist

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.checkpoint import CheckpointCorruptError, CheckpointDirMismatchError
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks


def losses_body(cfg, steps):
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    start = trainer.step
    losses = [trainer._dp_mean(trainer.train_step()["loss"]) for _ in range(steps)]
    trainer.save()
    trainer.close()  # waits for the pruned steps' background deletions
    return start, losses, trainer.checkpoints.warnings


def error_body(cfg):
    try:
        Trainer(cfg, TinyConfig, TinyLM)
    except (CheckpointCorruptError, CheckpointDirMismatchError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_a_corrupt_newest_step_falls_back_and_continues_the_curve(ranks, tmp_path):
    corpus = write_corpus(str(tmp_path))
    reference = ranks(1).run(losses_body, tiny_config(corpus), 4)[0][1]
    ck = str(tmp_path / "ck")
    ranks(1).run(losses_body, tiny_config(corpus, checkpoint={"dir": ck}), 2)
    ranks(1).run(losses_body, tiny_config(corpus, checkpoint={"dir": ck}), 1)  # step_3, then damaged
    shard = next(os.path.join(ck, "step_3", n) for n in os.listdir(os.path.join(ck, "step_3")) if n.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    error = ranks(1).run(error_body, tiny_config(corpus, checkpoint={"dir": ck, "on_corrupt": "error"}))[0]
    assert error.startswith("CheckpointCorruptError: checkpoint") and "step_3" in error and "on_corrupt=error" in error
    start, rest, warned = ranks(1).run(losses_body, tiny_config(corpus, checkpoint={"dir": ck, "keep": 1}), 2)[0]
    assert start == 2 and len(warned) == 1 and "skipping step_3" in warned[0]
    assert rest == pytest.approx(reference[2:4], rel=1e-6, abs=1e-6)
    assert sorted(os.listdir(ck)) == ["config.yaml", "latest", "step_3.corrupt", "step_4"], "the bad step is kept"


def mismatch_body(ck):
    cfg = tiny_config(os.path.join(os.path.dirname(ck), "corpus.txt"), checkpoint={"dir": ck})
    if dist.get_rank() == 1:  # rank 1 looks at an empty directory of its own
        cfg.checkpoint.dir = ck + "-rank1"
    return error_body(cfg)


def test_ranks_seeing_different_checkpoints_fail_together(ranks, tmp_path):
    corpus = write_corpus(str(tmp_path))
    ck = str(tmp_path / "ck")
    ranks(1).run(losses_body, tiny_config(corpus, checkpoint={"dir": ck}), 1)
    errors = ranks(2).run(mismatch_body, ck)
    assert errors[0] == errors[1], errors
    assert "rank 0 sees step_1 (1 steps); rank 1 sees no checkpoint (0 steps)" in errors[0]
    assert "the ranks must see the same checkpoint directory (a shared filesystem)" in errors[0]
