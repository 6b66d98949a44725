"""config.json dicts <-> GPTConfig for the Llama family (no transformers needed to read them): each
model type round trips, transformers reads the export as the same type, unsupported fields raise one
ValueError naming them, and Mistral refuses only forwards longer than its sliding window."""
import pytest
import torch

from tpflash.models import GPT, GPTConfig
from tpflash.models.hf import hf_transformers_config
from tpflash.models.hf_config import config_from_hf_dict, hf_config_dict

BASE = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
TYPES = {
    "llama": dict(model_type="llama", **BASE),
    "mistral": dict(model_type="mistral", sliding_window=16, **BASE),
    "qwen2": dict(model_type="qwen2", use_sliding_window=False, sliding_window=4096, **BASE),
    "qwen3": dict(model_type="qwen3", head_dim=16, **BASE),
}


@pytest.mark.parametrize("model_type", TYPES)
def test_llama_family_config_round_trips(model_type):
    cfg = config_from_hf_dict(TYPES[model_type])
    exported = hf_config_dict(cfg)
    assert exported["model_type"] == model_type
    assert config_from_hf_dict(exported) == cfg
    assert hf_transformers_config(cfg).model_type == model_type


def test_family_fields_are_read():
    assert config_from_hf_dict(TYPES["mistral"]).sliding_window == 16
    qwen2 = config_from_hf_dict(TYPES["qwen2"])
    assert qwen2.qkv_bias is True and qwen2.bias is False and qwen2.sliding_window is None
    qwen3 = config_from_hf_dict(TYPES["qwen3"])
    assert qwen3.qk_norm and qwen3.head_size == 16 and qwen3.n_embd == 32
    no_head_dim = {k: v for k, v in TYPES["qwen3"].items() if k != "head_dim"}
    assert config_from_hf_dict(no_head_dim).head_size == 128  # Qwen3Config's default, as transformers reads it


@pytest.mark.parametrize("model_type,change,name", [
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    ("llama", dict(attention_bias=True), "attention_bias=True and mlp_bias=False"),
    ("llama", dict(model_type="gemma"), "model_type='gemma'"),
    ("llama", dict(rope_parameters=dict(rope_type="mrope", rope_theta=1e4)), "rope_type='mrope'"),
])
def test_unsupported_field_raises_naming_it(model_type, change, name):
    with pytest.raises(ValueError, match=name):
        config_from_hf_dict({**TYPES[model_type], **change})


def test_config_without_hf_model_type_raises():
    cfg = GPTConfig.preset("llama-tiny", bias=True, qkv_bias=False)
    with pytest.raises(ValueError, match="qkv_bias=False with bias=True"):
        hf_config_dict(cfg)


def test_mistral_refuses_only_sequences_longer_than_the_window():
    model = GPT(config_from_hf_dict(TYPES["mistral"]))  # sliding_window=16
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape[1] == 16
    with pytest.raises(ValueError, match="length 24 exceeds sliding_window=16"):
        model(torch.zeros(1, 24, dtype=torch.long))
    cu = torch.tensor([0, 12, 24], dtype=torch.int32)  # packed: documents of 12 fit the window
    assert model(torch.zeros(1, 24, dtype=torch.long), cu_seqlens=cu, max_seqlen=12).shape[1] == 24
