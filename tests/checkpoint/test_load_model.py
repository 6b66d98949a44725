"""tpflash.checkpoint.load_model: a GPT saved at tp=2 comes back from its recorded config at tp=1 (one
process, no torch.distributed) and at tp=2, in eval mode, with the logits of the model that saved it."""
import json
import os

import pytest
import torch
import torch.distributed as dist

import tpflash
from tests.distributed.checks import init_tp

pytestmark = pytest.mark.cpu_ranks
GPT_CONFIG = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.1)
IDX = torch.arange(12).remainder(64).reshape(2, 6)


def full_logits(model, ps=None):
    """The model's logits on IDX, gathered over its tp group ([2, 6, vocab])."""
    with torch.no_grad():
        local = model(IDX)
    if ps is None or ps.tp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ps.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=ps.tp_group)
    return torch.cat(parts, dim=-1)


def save_body(root):
    ps = init_tp(2)
    torch.manual_seed(0)
    model = tpflash.models.GPT(tpflash.models.GPTConfig(**GPT_CONFIG))
    tpflash.checkpoint.save(root, model, step=5)
    return full_logits(model.eval(), ps)


def load_body(root, tp, fsdp):
    ps = init_tp(tp)
    model = tpflash.checkpoint.load_model(root, fsdp=fsdp)
    return full_logits(model, ps), model.training, model.config.dropout


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("load_model") / "ckpt")
    return root, ranks(2).run(save_body, root)[0]


def test_load_model_at_tp1_in_one_process_gives_the_saving_models_logits(saved):
    root, expected = saved
    model = tpflash.checkpoint.load_model(root)  # no process group in this process: tp=1
    assert not model.training and model.config == tpflash.models.GPTConfig(**GPT_CONFIG)
    torch.testing.assert_close(full_logits(model), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp, fsdp", [(2, False), (1, True)], ids=["tp2", "dp2-fsdp"])
def test_load_model_on_two_ranks_gives_the_saving_models_logits(ranks, saved, tp, fsdp):
    root, expected = saved
    for logits, training, dropout in ranks(2).run(load_body, root, tp, fsdp):
        assert not training and dropout == 0.1
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_load_model_takes_overrides_and_a_step_directory(saved):
    root, expected = saved
    model = tpflash.checkpoint.load_model(tpflash.checkpoint.latest(root), dropout=0.0, dtype=torch.float64)
    assert model.config.dropout == 0.0 and next(model.parameters()).dtype == torch.float64
    torch.testing.assert_close(full_logits(model).float(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"\['n_heads'\] are not fields of GPTConfig"):
        tpflash.checkpoint.load_model(root, n_heads=4)


def test_a_checkpoint_without_a_recorded_config_says_how_to_load_it(saved, tmp_path):
    root, _ = saved
    step = tpflash.checkpoint.latest(root)
    os.rename(os.path.join(step, "model_config.json"), tmp_path / "moved.json")
    try:
        with pytest.raises(ValueError, match=r"has no model_config.json.*tpflash.checkpoint.load\(path, model\)"):
            tpflash.checkpoint.load_model(root)
    finally:
        os.rename(tmp_path / "moved.json", os.path.join(step, "model_config.json"))
    assert json.load(open(os.path.join(step, "model_config.json")))["fields"]["n_head"] == 2
