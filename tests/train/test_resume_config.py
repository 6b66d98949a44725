"""A resumed run takes its model config from the checkpoint: no --model keys needed, and a key that
changes the model (even keeping every shape, as n_head does) is one ValueError unless allowed."""
import json
import shutil

import pytest
import torch

from tests.distributed.checks import assert_close
from tests.train.common import tiny_config, write_corpus
from tpflash.models import GPTConfig
from tpflash.train import resume_config
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks

MODEL = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16}
STEPS, FIRST = 6, 3


def gpt_config(corpus, ckpt=None, model=MODEL, **checkpoint):
    cfg = tiny_config(corpus, train={"steps": STEPS}, checkpoint={"dir": ckpt or "", **checkpoint})
    cfg.model = dict(model)  # replaces tiny_config's own model keys: {} means none at all
    return cfg


def steps_body(cfg, steps):
    """Resume (when cfg.checkpoint.dir has a checkpoint), run `steps` steps, save; (start step, losses, n_head)."""
    trainer = Trainer(cfg)
    start = trainer.step
    losses = [trainer._dp_mean(trainer.train_step()["loss"]) for _ in range(steps)]
    trainer.save()
    return start, losses, trainer.model_config.n_head


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def first_part(ranks, corpus, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("resume") / "ckpt")
    ranks(1).run(steps_body, gpt_config(corpus, ckpt), FIRST)
    return ckpt


def copy_of(first_part, tmp_path):
    """A copy of the first part's checkpoint for a run that resumes and saves (the others read it unchanged)."""
    return shutil.copytree(first_part, str(tmp_path / "ckpt"))


def test_resume_without_model_keys_continues_the_uninterrupted_curve(ranks, corpus, first_part, tmp_path):
    _, whole, _ = ranks(1).run(steps_body, gpt_config(corpus), STEPS)[0]
    _, first, _ = ranks(1).run(steps_body, gpt_config(corpus), FIRST)[0]
    ckpt = copy_of(first_part, tmp_path)
    start, rest, n_head = ranks(1).run(steps_body, gpt_config(corpus, ckpt, model={}), STEPS - FIRST)[0]
    assert start == FIRST and n_head == 2
    assert_close(torch.tensor(first + rest), torch.tensor(whole), "loss curve resumed without model keys", tol=1e-6)


def test_a_shape_keeping_architecture_change_names_the_field_before_any_process_group(corpus, first_part):
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in n_head: checkpoint 2, this run 4 "
                                         r"\(from --model.n_head\).*--checkpoint.allow_config_change=n_head"):
        Trainer(gpt_config(corpus, first_part, model={**MODEL, "n_head": 4}))  # raises before parallel.init


def test_allow_config_change_accepts_the_deliberate_change(ranks, corpus, first_part, tmp_path):
    cfg = gpt_config(corpus, copy_of(first_part, tmp_path), model={"n_head": 4}, allow_config_change=["n_head"])
    start, losses, n_head = ranks(1).run(steps_body, cfg, 1)[0]
    assert start == FIRST and n_head == 4 and torch.isfinite(torch.tensor(losses)).all()


def _checkpoint_dir(tmp_path, **fields):
    """A directory holding only model_config.json, as resolve_against reads it."""
    saved = GPTConfig(**{**MODEL, "vocab_size": 256, **fields})
    (tmp_path / "model_config.json").write_text(json.dumps(
        {"class": "tpflash.models.config.GPTConfig", "fields": saved.to_dict(), "model_class": "tpflash.models.gpt.GPT"}))
    return str(tmp_path)


def test_run_only_fields_may_change_and_unset_fields_come_from_the_checkpoint(tmp_path):
    path = _checkpoint_dir(tmp_path, sequence_parallel=True, dropout=0.1)
    keys = {"activation_checkpointing": True, "fused_loss": False, "init_std": 0.01, "seed": 5, "fp8": "rowwise"}
    got = resume_config.resolve_against(path, path, keys, [], 256, GPTConfig)
    assert (got.n_head, got.dropout, got.sequence_parallel, got.activation_checkpointing) == (2, 0.1, True, True)
    assert got.fp8 == "rowwise"


def test_a_preset_names_every_field_it_describes_but_the_tokenizers_vocabulary(tmp_path):
    path = _checkpoint_dir(tmp_path, n_layer=4, n_head=4, n_embd=128, block_size=256)
    assert resume_config.resolve_against(path, path, {"preset": "gpt2-tiny"}, [], 256, GPTConfig).n_layer == 4
    with pytest.raises(ValueError, match=r"n_layer: checkpoint 4, this run 2 \(from --model.n_layer\)"):
        resume_config.resolve_against(path, path, {"preset": "gpt2-tiny", "n_layer": 2}, [], 256, GPTConfig)
    with pytest.raises(ValueError, match=r"n_embd: checkpoint 128, this run 64 \(from --model.n_embd\); "
                                         r"dropout: checkpoint 0.0, this run 0.1"):
        resume_config.resolve_against(path, path, {"n_embd": 64, "dropout": 0.1}, [], 256, GPTConfig)


def test_the_tokenizer_must_fit_the_checkpoints_vocabulary(tmp_path):
    path = _checkpoint_dir(tmp_path)
    with pytest.raises(ValueError, match=r"the tokenizer has 50257 ids but the checkpoint's model has vocab_size=256"):
        resume_config.resolve_against(path, path, {}, [], 50257, GPTConfig)


def test_without_a_recorded_config_the_error_says_how_to_resume(tmp_path):
    with pytest.raises(ValueError, match=r"records no model config.*pass --model.preset=NAME or the --model.\* keys"):
        resume_config.resolve_against(str(tmp_path), str(tmp_path), {}, [], 256, GPTConfig)
    with pytest.raises(ValueError, match=r"allow_config_change=n_heads: \['n_heads'\] are not model config fields"):
        resume_config.check_allowed(["n_heads"], GPTConfig)


def test_a_model_without_config_resumes_from_the_keys_in_config_yaml(tmp_path):
    from tests.train.tiny_model import TinyConfig
    (tmp_path / "config.yaml").write_text("model:\n  block_size: 16\n  n_embd: 48\n")
    got = resume_config.resolve_against(str(tmp_path / "step_3"), str(tmp_path), {}, [], 256, TinyConfig)
    assert (got.n_embd, got.block_size, got.vocab_size) == (48, 16, 256)
    with pytest.raises(ValueError, match=r"n_embd: checkpoint 48, this run 32"):
        resume_config.resolve_against(str(tmp_path / "step_3"), str(tmp_path), {"n_embd": 32}, [], 256, TinyConfig)
