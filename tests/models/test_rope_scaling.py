"""Every rope_type transformers gives Llama (default, linear, dynamic, llama3, yarn, longrope) gives its
logits to 1e-4 (fp32, tp 1) through from_hf, on a sequence that exercises the scaled branch (the scaled
model differs from the same weights under plain RoPE); rope parameters are read from transformers 5's
rope_parameters and from the older rope_scaling + rope_theta; config.json round trips."""
import dataclasses
import json

import pytest
import torch

from tpflash.models import from_hf, to_hf
from tpflash.models.hf import hf_transformers_config
from tpflash.models.hf_config import config_from_hf_dict, hf_config_dict

VOCAB = 101
HALF = 4  # head_dim 8 -> 4 frequencies
ROPES = {  # rope_type: (rope parameters, sequence length that reaches the scaled branch)
    "linear": (dict(factor=2.0), 16),
    "dynamic": (dict(factor=2.0), 24),  # 24 > max_position_embeddings=16: the NTK base grows
    "llama3": (dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=4), 16),
    "yarn": (dict(factor=4.0, original_max_position_embeddings=4), 16),
    "longrope": (dict(short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[2.0, 3.0, 4.0, 5.0],
                      original_max_position_embeddings=8), 16),  # 16 > 8: the long factors
}


def tiny_llama(rope_type, **kw):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    scaling = None if rope_type == "default" else dict(rope_type=rope_type, **ROPES[rope_type][0])
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rms_norm_eps=1e-5, rope_theta=100.0, rope_scaling=scaling, **kw)
    return transformers.LlamaForCausalLM(config).eval()


def logits(model, seq):
    """Logits [2, seq, VOCAB] of a tpflash GPT or a transformers model on fixed random ids."""
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, seq))
    with torch.no_grad():
        out = model(idx)
        return out[..., :VOCAB] if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("rope_type", ["default", *ROPES])
def test_rope_type_matches_hf_logits(rope_type):
    hf = tiny_llama(rope_type)
    seq = ROPES.get(rope_type, (None, 16))[1]
    model = from_hf(hf).eval()
    gap = (logits(model, seq) - logits(hf, seq)).abs().max()
    assert gap < 1e-4
    if rope_type != "default":  # the scaling changes the logits at this length (tiny random logits: ~1e-4)
        plain = from_hf(hf, rope_scaling=None, block_size=32).eval()
        assert (logits(plain, seq) - logits(hf, seq)).abs().max() > max(20 * gap, 2e-5)


def test_longrope_short_sequences_use_the_short_factors():
    hf = tiny_llama("longrope")
    model = from_hf(hf).eval()
    assert (logits(model, 8) - logits(hf, 8)).abs().max() < 1e-4


def test_llama31_config_json_reads_rope_scaling_and_rope_theta():
    """A Llama 3.1 config.json (rope_scaling + rope_theta, no rope_parameters) and its transformers 5
    to_dict() (rope_parameters, theta inside) give the same GPTConfig."""
    old = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
               rope_theta=500000.0, tie_word_embeddings=True,
               rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192, rope_type="llama3"))
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = dict(old["rope_scaling"], rope_theta=500000.0)
    cfg = config_from_hf_dict(old)
    assert cfg == config_from_hf_dict(new)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3" and cfg.tie_embeddings


@pytest.mark.parametrize("rope_type", ["default", *ROPES])
def test_config_round_trips_and_transformers_reads_the_export(rope_type):
    hf = tiny_llama(rope_type, tie_word_embeddings=rope_type == "llama3")
    cfg = from_hf(hf).config
    exported = json.loads(json.dumps(hf_config_dict(cfg)))  # what config.json holds
    assert config_from_hf_dict(exported) == cfg
    assert config_from_hf_dict(hf_transformers_config(cfg).to_dict()) == cfg
    seq = ROPES.get(rope_type, (None, 16))[1]
    back = to_hf(from_hf(hf))  # a transformers model built from the exported config
    assert (logits(back, seq) - logits(hf, seq)).abs().max() < 1e-5


def test_llama_head_dim_other_than_hidden_over_heads_matches_hf():
    hf = tiny_llama("default", head_dim=16)
    model = from_hf(hf).eval()
    assert model.config.head_size == 16 and model.blocks[0].attn.q_proj.weight.shape == (64, 32)
    assert (logits(model, 16) - logits(hf, 16)).abs().max() < 1e-4


@pytest.mark.parametrize("change,name", [
    (dict(rope_type="su"), "rope_type='su'"),
    (dict(rope_type="linear"), "needs rope parameter\\(s\\) \\['factor'\\]"),
    (dict(rope_type="linear", factor=2.0, partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
])
def test_unsupported_rope_parameters_raise(change, name):
    c = hf_config_dict(dataclasses.replace(from_hf(tiny_llama("default")).config))
    c["rope_scaling"] = change
    with pytest.raises(ValueError, match=name):
        config_from_hf_dict(c)
