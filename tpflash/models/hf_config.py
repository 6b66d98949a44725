"""Hugging Face `config.json` (a plain dict) <-> GPTConfig, without importing transformers.

`config_from_hf_dict` reads the dict `json.load(open(hf_dir + "/config.json"))` gives (or
`transformers_config.to_dict()`); `hf_config_dict` writes the dict of a config.json that
`transformers.AutoConfig` reads back. Unsupported model types and fields raise one ValueError
naming the value.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

from .config import GPTConfig

HFDict = Dict[str, Any]
_GPT2_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}


def family(model_type: str) -> str:
    """The tpflash key family ("gpt2" or "llama") of an HF model_type; ValueError for unsupported ones."""
    if model_type not in _READERS:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {sorted(_READERS)}")
    return "gpt2" if model_type == "gpt2" else "llama"


def _gpt2(c: HFDict) -> GPTConfig:
    act = c.get("activation_function", "gelu_new")
    if act not in _GPT2_ACT:
        raise ValueError(f"activation_function={act!r} must be one of {sorted(_GPT2_ACT)}")
    if not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx", False):
        raise ValueError("only GPT-2 attention scaled by 1/sqrt(head_dim) is supported (scale_attn_weights=True, "
                         "scale_attn_by_inverse_layer_idx=False)")
    n_embd = c["n_embd"]
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
                     n_head=c["n_head"], n_embd=n_embd, ffn_hidden=c.get("n_inner") or 4 * n_embd,
                     mlp=_GPT2_ACT[act], norm="layernorm", position="learned",
                     tie_embeddings=c.get("tie_word_embeddings", True), bias=True,
                     norm_eps=c.get("layer_norm_epsilon", 1e-5))


def _rope_theta(c: HFDict) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported (only 'default' rotary embeddings)")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def _llama(c: HFDict) -> GPTConfig:
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} must be 'silu' (SwiGLU)")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"head_dim={head_dim} must equal hidden_size/num_attention_heads={hidden}/{heads}")
    attention_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError(f"attention_bias={attention_bias} and mlp_bias={mlp_bias} must be equal")
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
                     n_layer=c["num_hidden_layers"], n_head=heads, n_embd=hidden,
                     n_kv_head=c.get("num_key_value_heads") or heads, ffn_hidden=c["intermediate_size"],
                     mlp="swiglu", norm="rmsnorm", position="rotary",
                     tie_embeddings=c.get("tie_word_embeddings", False), bias=attention_bias,
                     norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=_rope_theta(c))


_READERS: Dict[str, Callable[[HFDict], GPTConfig]] = {"gpt2": _gpt2, "llama": _llama}


def config_from_hf_dict(c: HFDict) -> GPTConfig:
    """The GPTConfig of an HF config dict (config.json's contents)."""
    model_type = c.get("model_type")
    family(model_type)  # raises for unsupported types
    return _READERS[model_type](c)


def hf_config_dict(cfg: GPTConfig) -> HFDict:
    """A config.json dict for `cfg` (model_type, architectures and the family's fields)."""
    if cfg.position == "learned" and cfg.norm == "layernorm" and cfg.mlp != "swiglu" and cfg.bias and \
            cfg.kv_heads == cfg.n_head:
        act = {v: k for k, v in _GPT2_ACT.items() if k != "gelu_pytorch_tanh"}[cfg.mlp]
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                    n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_inner=cfg.ffn_dim, activation_function=act, layer_norm_epsilon=cfg.norm_eps,
                    resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=0.0,
                    tie_word_embeddings=cfg.tie_embeddings, bos_token_id=0, eos_token_id=0)
    if cfg.position == "rotary" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu":
        return dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
                    num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                    max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
                    rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                    tie_word_embeddings=cfg.tie_embeddings)
    raise ValueError("this GPTConfig is neither GPT-2 shaped (learned positions, LayerNorm, GELU/ReLU, biases, "
                     "no GQA) nor Llama shaped (rotary, RMSNorm, SwiGLU)")
