"""A checkpoint saved at (dp=2, tp=2) under FSDP loads at (1, 1), (1, 4) and (4, 1) with identical
parameters and optimizer state (the vocabulary is padded differently at each tp), and training
continued after the resharded resume equals continuing the original run (fp32, 1e-5)."""
import pytest
import torch
from torch.distributed.tensor import DTensor

import tpflash
from tests.checkpoint.tiny_model import build, full_state, make_optimizer, train
from tests.distributed.checks import assert_close, init_tp

pytestmark = pytest.mark.cpu_ranks  # the tiny models live on CPU: gloo even where GPUs are visible

SAVE_AT, MORE = 3, 3  # train 3 steps, save, train 3 more


def _no_gather(*args, **kwargs):
    raise AssertionError("checkpoint save gathered an FSDP tensor over dp")


def save_body(root):
    """At (dp=2, tp=2) with FSDP: train, save, record the state, train on; return (saved, final) states."""
    ps = init_tp(2)
    model = tpflash.parallel.apply_fsdp(build(seed=0), ps)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(SAVE_AT), ps.dp_rank, ps.dp_size)
    full_tensor, DTensor.full_tensor = DTensor.full_tensor, _no_gather  # each rank writes its own dp block
    try:
        tpflash.checkpoint.save(root, model, optimizer, step=SAVE_AT, data_position=SAVE_AT * 8)
    finally:
        DTensor.full_tensor = full_tensor
    saved = full_state(model, optimizer)
    train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), ps.dp_rank, ps.dp_size)
    return saved, full_state(model, optimizer)


def resume_body(root, tp, fsdp, saved, final):
    """Resume at tp (dp = the rest); fsdp: 0 none, n: FSDP with n HSDP replicas (1: plain FSDP)."""
    ps = init_tp(tp)
    model = build(seed=1)  # different weights: the load must overwrite all of them
    if fsdp:
        model = tpflash.parallel.apply_fsdp(model, ps, hsdp_replicas=fsdp)
    optimizer = make_optimizer(model)
    info = tpflash.checkpoint.load(root, model, optimizer)
    assert info == {"step": SAVE_AT, "data_position": SAVE_AT * 8}, info
    loaded = full_state(model, optimizer)
    assert loaded.keys() == saved.keys(), sorted(set(loaded) ^ set(saved))
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), f"{key} differs after the resharded load"
    train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), ps.dp_rank, ps.dp_size)
    continued = full_state(model, optimizer)
    for key, value in final.items():
        if not key.endswith(".step"):
            assert_close(continued[key], value, key, tol=1e-5)


@pytest.fixture(scope="module")
def saved_run(ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt") / "run")
    saved, final = ranks(4).run(save_body, root)[0]
    return root, saved, final


def test_fsdp_tp_checkpoint_commits_step_directory(saved_run):
    root, _, _ = saved_run
    assert tpflash.checkpoint.latest(root).endswith(f"step_{SAVE_AT}")


@pytest.mark.parametrize("world,tp,fsdp", [(1, 1, 0), (4, 4, 0), (4, 1, 1), (4, 1, 2)],
                         ids=["dp1-tp1", "dp1-tp4", "dp4-tp1-fsdp", "dp4-tp1-hsdp2x2"])
def test_resume_at_other_layout_restores_state_and_continues_like_original(ranks, saved_run, world, tp, fsdp):
    root, saved, final = saved_run
    ranks(world).run(resume_body, root, tp, fsdp, saved, final)


# A Llama-style GPT (untied head, kv heads replicated at tp=4, vocab 61 padded differently at each tp)
GPT_CONFIG = dict(vocab_size=61, block_size=8, n_layer=1, n_head=4, n_kv_head=2, n_embd=16, ffn_hidden=32,
                  mlp="swiglu", norm="rmsnorm", position="rotary", tie_embeddings=False, bias=False)


def _gpt(seed):
    torch.manual_seed(seed)
    return tpflash.models.GPT(tpflash.models.GPTConfig(**GPT_CONFIG))


def gpt_save_body(root, tp=2, hsdp_replicas=1):
    ps = init_tp(tp)
    model = tpflash.parallel.apply_fsdp(_gpt(0), ps, hsdp_replicas=hsdp_replicas)
    tpflash.checkpoint.save(root, model, step=0)
    return tpflash.parallel.full_state_dict(model)


def gpt_load_body(root, tp, expected):
    init_tp(tp)
    model = _gpt(1)
    tpflash.checkpoint.load(root, model)
    full = tpflash.parallel.full_state_dict(model)
    assert full.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(full[key], value), f"{key} differs after loading at tp={tp}"


def test_gpt_saved_under_fsdp_tp2_loads_at_tp4_and_tp1(ranks, tmp_path):
    root = str(tmp_path / "gpt")
    expected = ranks(4).run(gpt_save_body, root)[0]
    ranks(4).run(gpt_load_body, root, 4, expected)
    ranks(1).run(gpt_load_body, root, 1, expected)


def test_gpt_saved_under_hsdp_loads_at_tp2(ranks, tmp_path):
    root = str(tmp_path / "gpt")
    expected = ranks(4).run(gpt_save_body, root, 1, 2)[0]  # tp=1, 2 replicas x 2 shards
    ranks(4).run(gpt_load_body, root, 2, expected)
