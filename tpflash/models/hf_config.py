"""Hugging Face `config.json` (a plain dict) <-> GPTConfig, without importing transformers.

`config_from_hf_dict` reads the dict `json.load(open(hf_dir + "/config.json"))` gives (or
`transformers_config.to_dict()`); `hf_config_dict` writes the dict of a config.json that
`transformers.AutoConfig` reads back. Unsupported model types and fields raise one ValueError
naming the value.

Supported model types: gpt2, and the Llama family, which shares one tensor layout:
  llama    Llama 1/2/3 (rope_type default, linear, dynamic, llama3, yarn, longrope; tied or not)
  mistral  llama + sliding_window (tpflash refuses forwards longer than the window)
  qwen2    llama + biases on q/k/v only (qkv_bias=True, bias=False); no sliding windows
  qwen3    llama + per-head q/k RMSNorm (qk_norm) and a free head_dim; no sliding windows
RoPE parameters are read from `rope_parameters` (transformers 5, rope_theta inside) or from
`rope_scaling` + `rope_theta` (older config.json files), and written in the older form, which every
transformers version reads.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from ..layers.rotary import ROPE_TYPES, rope_keys
from .config import GPTConfig

HFDict = Dict[str, Any]
_GPT2_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}
_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")  # rope types whose original length defaults to max positions


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


def _rope(c: HFDict) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, GPTConfig.rope_scaling) of a Llama-family config, as transformers 5 resolves them:
    rope_scaling takes precedence over rope_parameters, rope_theta inside them over the top-level one."""
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope parameters per layer type ({sorted(params)}) are not supported")
    theta = float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type={kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (rotary over the whole head only)")
    if kind == "default":
        return theta, None
    # Other keys are ignored, as transformers' Llama ignores them.
    scaling = {"rope_type": kind, **{k: params[k] for k in rope_keys(kind) if params.get(k) is not None}}
    if kind in _ORIGINAL_LENGTH:  # transformers: a top-level original length wins, else max positions
        scaling["original_max_position_embeddings"] = c.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings") or c["max_position_embeddings"])
    return theta, scaling


def _decoder(c: HFDict, default_head_dim: Optional[int] = None, **fields) -> GPTConfig:
    """The GPTConfig of a Llama-family config dict; `fields` set the family's own GPTConfig fields."""
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} must be 'silu' (SwiGLU)")
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim", default_head_dim) or hidden // heads
    theta, scaling = _rope(c)
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["max_position_embeddings"],
                     n_layer=c["num_hidden_layers"], n_head=heads, n_embd=hidden, head_dim=head_dim,
                     n_kv_head=c.get("num_key_value_heads") or heads, ffn_hidden=c["intermediate_size"],
                     mlp="swiglu", norm="rmsnorm", position="rotary",
                     tie_embeddings=c.get("tie_word_embeddings", False), norm_eps=c.get("rms_norm_eps", 1e-6),
                     rope_theta=theta, rope_scaling=scaling, **fields)


def _llama(c: HFDict) -> GPTConfig:
    attention_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError(f"attention_bias={attention_bias} and mlp_bias={mlp_bias} must be equal")
    return _decoder(c, bias=attention_bias)


def _mistral(c: HFDict) -> GPTConfig:
    return _decoder(c, bias=False, sliding_window=c.get("sliding_window"))


def _no_sliding_window(c: HFDict) -> None:
    if c.get("use_sliding_window", False):
        raise ValueError(f"use_sliding_window=True (sliding_window={c.get('sliding_window')}) is not supported "
                         f"for model_type={c['model_type']!r}")


def _qwen2(c: HFDict) -> GPTConfig:
    _no_sliding_window(c)
    return _decoder(c, bias=False, qkv_bias=True)


def _qwen3(c: HFDict) -> GPTConfig:
    _no_sliding_window(c)
    if c.get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported for qwen3 (o_proj would have a bias, the MLP none)")
    return _decoder(c, default_head_dim=128, bias=False, qk_norm=True)  # 128: Qwen3Config's default


_READERS: Dict[str, Callable[[HFDict], GPTConfig]] = {"gpt2": _gpt2, "llama": _llama, "mistral": _mistral,
                                                      "qwen2": _qwen2, "qwen3": _qwen3}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def config_from_hf_dict(c: HFDict) -> GPTConfig:
    """The GPTConfig of an HF config dict (config.json's contents)."""
    model_type = c.get("model_type")
    family(model_type)  # raises for unsupported types
    return _READERS[model_type](c)


def _is_gpt2(cfg: GPTConfig) -> bool:
    return (cfg.position == "learned" and cfg.norm == "layernorm" and cfg.mlp != "swiglu" and cfg.bias
            and cfg.kv_heads == cfg.n_head and cfg.head_dim is None and cfg.qkv_bias is None and not cfg.qk_norm
            and cfg.rope_scaling is None and cfg.sliding_window is None)


def _llama_model_type(cfg: GPTConfig) -> str:
    """Which Llama-family model_type expresses cfg; ValueError naming the field none can."""
    qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
    if cfg.qk_norm:
        if cfg.bias or qkv_bias or cfg.sliding_window is not None:
            raise ValueError("qk_norm=True (qwen3) needs bias=False, qkv_bias=False and sliding_window=None")
        return "qwen3"
    if cfg.sliding_window is not None:
        if cfg.bias or qkv_bias:
            raise ValueError(f"sliding_window={cfg.sliding_window} (mistral) needs bias=False and qkv_bias=False")
        return "mistral"
    if qkv_bias != cfg.bias:
        if not qkv_bias:
            raise ValueError("qkv_bias=False with bias=True has no Hugging Face model type")
        return "qwen2"
    return "llama"


def hf_config_dict(cfg: GPTConfig) -> HFDict:
    """A config.json dict for `cfg` (model_type, architectures and the family's fields)."""
    if _is_gpt2(cfg):
        act = {v: k for k, v in _GPT2_ACT.items() if k != "gelu_pytorch_tanh"}[cfg.mlp]
        return dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
                    n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_inner=cfg.ffn_dim, activation_function=act, layer_norm_epsilon=cfg.norm_eps,
                    resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=0.0,
                    tie_word_embeddings=cfg.tie_embeddings, bos_token_id=0, eos_token_id=0)
    if not (cfg.position == "rotary" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu"):
        raise ValueError("this GPTConfig is neither GPT-2 shaped (learned positions, LayerNorm, GELU/ReLU, biases, "
                         "no GQA) nor Llama shaped (rotary, RMSNorm, SwiGLU)")
    model_type = _llama_model_type(cfg)
    d = dict(model_type=model_type, architectures=[_ARCHITECTURES[model_type]], vocab_size=cfg.vocab_size,
             hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
             num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_size,
             max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
             rope_theta=cfg.rope_theta, rope_scaling=None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
             tie_word_embeddings=cfg.tie_embeddings)
    if model_type == "llama":
        d.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    elif model_type == "mistral":
        d.update(sliding_window=cfg.sliding_window)
    else:
        d.update(use_sliding_window=False, **({"attention_bias": False} if model_type == "qwen3" else {}))
    return d
