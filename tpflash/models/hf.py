"""Hugging Face import/export: GPT2LMHeadModel and LlamaForCausalLM <-> tpflash GPT.

Conversion goes through the *full* (unsharded) state dict: `from_hf` maps the HF tensors to
tpflash keys and each rank keeps its shard (load_full_state_dict, no communication);
`to_hf` gathers the full tensors (full_state_dict, a collective) and maps them back.
GPT-2's Conv1D layers store weights as [in, out] (y = x W + b): they are transposed to
nn.Linear's [out, in], and its fused c_attn ([hidden, 3*hidden]) is split into q, k, v.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict

import torch

from ..parallel import full_state_dict, load_full_state_dict
from .config import GPTConfig
from .gpt import GPT

StateDict = Dict[str, torch.Tensor]
_GPT2_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact", "relu": "relu"}
_LLAMA_NAMES = {  # tpflash block key -> Llama decoder-layer key
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}_proj.{w}": f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")},
    **{f"mlp.{p}_proj.{w}": f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")},
}


def _family(model_type: str) -> str:
    if model_type not in ("gpt2", "llama"):
        raise ValueError(f"model_type={model_type!r} is not supported; from_hf/to_hf handle 'gpt2' and 'llama'")
    return model_type


# ---- configs --------------------------------------------------------------------------------------
def _gpt2_config(c) -> GPTConfig:
    if c.activation_function not in _GPT2_ACT:
        raise ValueError(f"activation_function={c.activation_function!r} must be one of {sorted(_GPT2_ACT)}")
    if not c.scale_attn_weights or c.scale_attn_by_inverse_layer_idx:
        raise ValueError("only GPT-2 attention scaled by 1/sqrt(head_dim) is supported (scale_attn_weights=True, "
                         "scale_attn_by_inverse_layer_idx=False)")
    return GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                     n_embd=c.n_embd, ffn_hidden=c.n_inner or 4 * c.n_embd, mlp=_GPT2_ACT[c.activation_function],
                     norm="layernorm", position="learned", tie_embeddings=c.tie_word_embeddings, bias=True,
                     norm_eps=c.layer_norm_epsilon)


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    scaling = getattr(c, "rope_scaling", None) or {}
    kind = params.get("rope_type", scaling.get("rope_type", "default"))
    if kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported (only 'default' rotary embeddings)")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _llama_config(c) -> GPTConfig:
    if c.hidden_act != "silu":
        raise ValueError(f"hidden_act={c.hidden_act!r} must be 'silu' (SwiGLU)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"head_dim={head_dim} must equal hidden_size/num_attention_heads="
                         f"{c.hidden_size}/{c.num_attention_heads}")
    if c.attention_bias != getattr(c, "mlp_bias", False):
        raise ValueError(f"attention_bias={c.attention_bias} and mlp_bias={c.mlp_bias} must be equal")
    return GPTConfig(vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
                     n_head=c.num_attention_heads, n_embd=c.hidden_size, n_kv_head=c.num_key_value_heads,
                     ffn_hidden=c.intermediate_size, mlp="swiglu", norm="rmsnorm", position="rotary",
                     tie_embeddings=c.tie_word_embeddings, bias=c.attention_bias, norm_eps=c.rms_norm_eps,
                     rope_theta=_rope_theta(c))


def _hf_config(cfg: GPTConfig):
    """The transformers config (GPT2Config or LlamaConfig) of a tpflash config."""
    import transformers

    if cfg.position == "learned" and cfg.norm == "layernorm" and cfg.mlp != "swiglu" and cfg.bias and \
            cfg.kv_heads == cfg.n_head:
        act = {v: k for k, v in _GPT2_ACT.items() if k != "gelu_pytorch_tanh"}[cfg.mlp]
        return transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
                                       n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.ffn_dim,
                                       activation_function=act, layer_norm_epsilon=cfg.norm_eps,
                                       resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=0.0,
                                       tie_word_embeddings=cfg.tie_embeddings)
    if cfg.position == "rotary" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu":
        return transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd,
                                        intermediate_size=cfg.ffn_dim, num_hidden_layers=cfg.n_layer,
                                        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
                                        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
                                        rope_theta=cfg.rope_theta, attention_bias=cfg.bias, mlp_bias=cfg.bias,
                                        tie_word_embeddings=cfg.tie_embeddings)
    raise ValueError("this GPTConfig is neither GPT-2 shaped (learned positions, LayerNorm, GELU/ReLU, biases, "
                     "no GQA) nor Llama shaped (rotary, RMSNorm, SwiGLU)")


# ---- state dicts ----------------------------------------------------------------------------------
def _gpt2_to_tpflash(hf: StateDict, cfg: GPTConfig) -> StateDict:
    t = {k.removeprefix("transformer."): v for k, v in hf.items()}
    out = {"tok_embeddings.weight": t["wte.weight"], "pos_embeddings.weight": t["wpe.weight"],
           "final_norm.weight": t["ln_f.weight"], "final_norm.bias": t["ln_f.bias"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(cfg.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        q, k, v = t[h + "attn.c_attn.weight"].t().chunk(3, dim=0)  # Conv1D [in, 3*out] -> 3 x [out, in]
        qb, kb, vb = t[h + "attn.c_attn.bias"].chunk(3)
        out.update({
            b + "attn_norm.weight": t[h + "ln_1.weight"], b + "attn_norm.bias": t[h + "ln_1.bias"],
            b + "attn.q_proj.weight": q, b + "attn.k_proj.weight": k, b + "attn.v_proj.weight": v,
            b + "attn.q_proj.bias": qb, b + "attn.k_proj.bias": kb, b + "attn.v_proj.bias": vb,
            b + "attn.o_proj.weight": t[h + "attn.c_proj.weight"].t(), b + "attn.o_proj.bias": t[h + "attn.c_proj.bias"],
            b + "mlp_norm.weight": t[h + "ln_2.weight"], b + "mlp_norm.bias": t[h + "ln_2.bias"],
            b + "mlp.up_proj.weight": t[h + "mlp.c_fc.weight"].t(), b + "mlp.up_proj.bias": t[h + "mlp.c_fc.bias"],
            b + "mlp.down_proj.weight": t[h + "mlp.c_proj.weight"].t(),
            b + "mlp.down_proj.bias": t[h + "mlp.c_proj.bias"],
        })
    return {k: v.contiguous() for k, v in out.items()}


def _tpflash_to_gpt2(sd: StateDict, cfg: GPTConfig) -> StateDict:
    out = {"transformer.wte.weight": sd["tok_embeddings.weight"], "transformer.wpe.weight": sd["pos_embeddings.weight"],
           "transformer.ln_f.weight": sd["final_norm.weight"], "transformer.ln_f.bias": sd["final_norm.bias"],
           "lm_head.weight": sd.get("lm_head.weight", sd["tok_embeddings.weight"])}
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        qkv = torch.cat([sd[b + f"attn.{p}_proj.weight"] for p in "qkv"], dim=0)
        out.update({
            h + "ln_1.weight": sd[b + "attn_norm.weight"], h + "ln_1.bias": sd[b + "attn_norm.bias"],
            h + "attn.c_attn.weight": qkv.t(), h + "attn.c_attn.bias": torch.cat([sd[b + f"attn.{p}_proj.bias"]
                                                                                  for p in "qkv"]),
            h + "attn.c_proj.weight": sd[b + "attn.o_proj.weight"].t(), h + "attn.c_proj.bias": sd[b + "attn.o_proj.bias"],
            h + "ln_2.weight": sd[b + "mlp_norm.weight"], h + "ln_2.bias": sd[b + "mlp_norm.bias"],
            h + "mlp.c_fc.weight": sd[b + "mlp.up_proj.weight"].t(), h + "mlp.c_fc.bias": sd[b + "mlp.up_proj.bias"],
            h + "mlp.c_proj.weight": sd[b + "mlp.down_proj.weight"].t(), h + "mlp.c_proj.bias": sd[b + "mlp.down_proj.bias"],
        })
    return {k: v.contiguous() for k, v in out.items()}


def _llama_key_map(cfg: GPTConfig) -> Dict[str, str]:
    """tpflash key -> Llama key, for every tensor of this config."""
    keys = {"tok_embeddings.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        keys["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.n_layer):
        for ours, theirs in _LLAMA_NAMES.items():
            if ours.endswith("bias") and not cfg.bias:
                continue
            keys[f"blocks.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return keys


def _llama_to_tpflash(hf: StateDict, cfg: GPTConfig) -> StateDict:
    return {ours: hf[theirs] for ours, theirs in _llama_key_map(cfg).items()}


def _tpflash_to_llama(sd: StateDict, cfg: GPTConfig) -> StateDict:
    out = {theirs: sd[ours] for ours, theirs in _llama_key_map(cfg).items()}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = sd["tok_embeddings.weight"]
    return out


_CONFIG: Dict[str, Callable] = {"gpt2": _gpt2_config, "llama": _llama_config}
_IMPORT: Dict[str, Callable] = {"gpt2": _gpt2_to_tpflash, "llama": _llama_to_tpflash}
_EXPORT: Dict[str, Callable] = {"gpt2": _tpflash_to_gpt2, "llama": _tpflash_to_llama}


# ---- public ---------------------------------------------------------------------------------------
def from_hf(hf_model, process_group=None, sequence_parallel: bool = False, **overrides) -> GPT:
    """A tpflash GPT with the weights of a transformers GPT2LMHeadModel or LlamaForCausalLM, sharded
    for `process_group` (default: the default tp group, or tp=1). `overrides` replace GPTConfig
    fields (e.g. dropout, activation_checkpointing). The model gets the HF weights' dtype, on CPU.
    No communication: every rank must hold the same HF model (e.g. loaded from the same files).
    """
    family = _family(hf_model.config.model_type)
    cfg = dataclasses.replace(_CONFIG[family](hf_model.config), sequence_parallel=sequence_parallel, **overrides)
    dtype = next(hf_model.parameters()).dtype
    with torch.device("meta"):  # skip the random init; every tensor is loaded below
        model = GPT(cfg, process_group=process_group, dtype=dtype)
    model.to_empty(device="cpu")
    load_full_state_dict(model, _IMPORT[family]({k: v.detach().cpu() for k, v in hf_model.state_dict().items()}, cfg))
    return model


def config_from_hf(hf_config) -> GPTConfig:
    """The GPTConfig of a transformers GPT2Config or LlamaConfig (ValueError for other model types)."""
    return _CONFIG[_family(hf_config.model_type)](hf_config)


def load_hf_weights(model: GPT, hf_dir: str) -> None:
    """Copy the weights of the Hugging Face model saved in `hf_dir` (GPT-2 or Llama, local files only)
    into `model`, a GPT built from `config_from_hf` of the same config (shape-changing overrides
    raise ValueError naming the tensor). Each rank reads the files and keeps its own shard: no
    communication. The tensors keep the model's dtype and device."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    family = _family(hf.config.model_type)
    load_full_state_dict(model, _IMPORT[family]({k: v.detach() for k, v in hf.state_dict().items()}, model.config))


def to_hf(model: GPT):
    """The transformers model (GPT2LMHeadModel or LlamaForCausalLM, on CPU, the model's dtype)
    holding `model`'s full weights. Collective over the model's tp group: call on all its ranks."""
    import transformers

    cfg = model.config
    hf_config = _hf_config(cfg)
    full = full_state_dict(model, device=torch.device("cpu"))
    family = _family(hf_config.model_type)
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM
    dtype = next(model.parameters()).dtype
    hf = cls(hf_config).to(dtype)
    missing, unexpected = hf.load_state_dict(_EXPORT[family](full, cfg), strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"to_hf: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()
