"""Single-process GPT checks: presets, bf16 autocast (what GPU training runs), config errors."""
import pytest
import torch

from tpflash.models import GPT, PRESETS, GPTConfig


def tiny(family, **kw):
    base = "gpt2-tiny" if family == "gpt2" else "llama-tiny"
    size = dict(vocab_size=101, block_size=16, n_layer=2, n_embd=32, n_head=4, ffn_hidden=64)
    if family == "qwen3":  # per-head q/k norm, heads wider than n_embd / n_head
        size.update(head_dim=16, qk_norm=True)
    return GPTConfig.preset(base, **{**size, **kw})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_config(name):
    cfg = GPTConfig.preset(name)
    cfg.check_tp(1 if name == "gpt2-xl" else 2)  # gpt2-xl's 25 heads split over 1, 5 or 25 ranks only


@pytest.mark.parametrize("fused_loss", [True, False])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3"])
def test_loss_under_bf16_autocast_is_close_to_fp32(family, fused_loss):
    torch.manual_seed(0)
    model = GPT(tiny(family, fused_loss=fused_loss))
    idx = torch.randint(0, 101, (2, 16))
    expected = model(idx, idx).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - expected) < 0.05
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_logits_mask_no_padding_at_tp1_and_match_the_loss():
    torch.manual_seed(0)
    model = GPT(tiny("llama", fused_loss=False))
    idx = torch.randint(0, 101, (2, 16))
    logits = model(idx)
    assert logits.shape == (2, 16, 101)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 101), idx.reshape(-1))
    assert torch.allclose(model(idx, idx), ref, atol=1e-5)


@pytest.mark.parametrize("kw,rule", [(dict(n_embd=30), "n_embd=30 is not divisible by n_head=4"),
                                     (dict(mlp="tanh"), "mlp='tanh' must be one of"),
                                     (dict(activation_checkpointing="some"), "activation_checkpointing='some'")])
def test_bad_config_names_the_rule(kw, rule):
    with pytest.raises(ValueError, match=rule):
        tiny("gpt2", **kw)


def test_sequence_longer_than_block_size_raises():
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        GPT(tiny("gpt2"))(torch.zeros(1, 17, dtype=torch.long))
