"""Hugging Face tensor names <-> tpflash GPT state-dict keys, and in-memory from_hf/to_hf.

`hf_sources(cfg, keys)` says, for every tpflash key, which Hugging Face tensor holds it and how:
most are the HF tensor as is; GPT-2's Conv1D layers store [in, out] (y = x W + b) and are
transposed to nn.Linear's [out, in], and its fused c_attn ([hidden, 3*hidden]) holds q, k, v as
three row blocks after the transpose. Both the in-memory conversion here and the streaming
load/export (tpflash.models.pretrained) read this one mapping.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..parallel import full_state_dict, load_full_state_dict
from .config import GPTConfig
from .gpt import GPT
from .hf_config import config_from_hf_dict, family, hf_config_dict

StateDict = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class HFSource:
    """Where a tpflash tensor lives in a Hugging Face checkpoint: tensor `key`, transposed first when
    `transpose` (GPT-2 Conv1D), then row block `part` = (i, n) of n equal blocks along dim 0 (GPT-2's
    fused q|k|v), else the whole tensor."""

    key: str
    transpose: bool = False
    part: Optional[Tuple[int, int]] = None

    def take(self, hf: torch.Tensor) -> torch.Tensor:
        """The tpflash tensor from the whole HF tensor."""
        t = hf.t() if self.transpose else hf
        if self.part is not None:
            i, n = self.part
            t = t.chunk(n, dim=0)[i]
        return t

    def box(self, rows: Tuple[int, int], hf_shape: Tuple[int, ...], cols: Optional[Tuple[int, int]] = None):
        """The slices of the HF tensor that hold rows [r0, r1) (and columns [c0, c1) of a matrix) of
        the tpflash tensor: (slices in the HF tensor's own dim order, transpose after reading)."""
        r0, r1 = rows
        if self.part is not None:
            i, n = self.part
            length = (hf_shape[1] if self.transpose else hf_shape[0]) // n
            r0, r1 = r0 + i * length, r1 + i * length
        row_slice = slice(r0, r1)
        if len(hf_shape) == 1:
            return (row_slice,), False
        col_slice = slice(*cols) if cols is not None else slice(None)
        return ((col_slice, row_slice), True) if self.transpose else ((row_slice, col_slice), False)


# tpflash block key -> Llama/Mistral/Qwen decoder-layer key
_LLAMA_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    **{f"attn.{p}_proj.{w}": f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")},
    **{f"attn.{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"},  # Qwen3's per-head q/k RMSNorm
    **{f"mlp.{p}_proj.{w}": f"mlp.{p}_proj.{w}" for p in ("gate", "up", "down") for w in ("weight", "bias")},
}
_LLAMA_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}
_GPT2_TOP = {"tok_embeddings.weight": "transformer.wte.weight", "pos_embeddings.weight": "transformer.wpe.weight",
             "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias",
             "lm_head.weight": "lm_head.weight"}
_GPT2_NAMES = {  # tpflash block key -> (GPT-2 block key, transpose, part)
    "attn_norm.weight": ("ln_1.weight", False, None), "attn_norm.bias": ("ln_1.bias", False, None),
    **{f"attn.{p}_proj.weight": ("attn.c_attn.weight", True, (i, 3)) for i, p in enumerate("qkv")},
    **{f"attn.{p}_proj.bias": ("attn.c_attn.bias", False, (i, 3)) for i, p in enumerate("qkv")},
    "attn.o_proj.weight": ("attn.c_proj.weight", True, None), "attn.o_proj.bias": ("attn.c_proj.bias", False, None),
    "mlp_norm.weight": ("ln_2.weight", False, None), "mlp_norm.bias": ("ln_2.bias", False, None),
    "mlp.up_proj.weight": ("mlp.c_fc.weight", True, None), "mlp.up_proj.bias": ("mlp.c_fc.bias", False, None),
    "mlp.down_proj.weight": ("mlp.c_proj.weight", True, None), "mlp.down_proj.bias": ("mlp.c_proj.bias", False, None),
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def _source(fam: str, key: str) -> HFSource:
    match = _BLOCK.fullmatch(key)
    if match is None:
        top = _GPT2_TOP if fam == "gpt2" else _LLAMA_TOP
        if key not in top:
            raise KeyError(f"{key}: no Hugging Face {fam} tensor holds it")
        return HFSource(top[key])
    i, rest = match.groups()
    if fam == "gpt2":
        if rest not in _GPT2_NAMES:
            raise KeyError(f"{key}: no Hugging Face gpt2 tensor holds it")
        name, transpose, part = _GPT2_NAMES[rest]
        return HFSource(f"transformer.h.{i}.{name}", transpose, part)
    if rest not in _LLAMA_NAMES:
        raise KeyError(f"{key}: no Hugging Face {fam} tensor holds it")
    return HFSource(f"model.layers.{i}.{_LLAMA_NAMES[rest]}")


def hf_family(cfg: GPTConfig) -> str:
    """"gpt2" or "llama": the tensor-name family of this config's Hugging Face model."""
    return family(hf_config_dict(cfg)["model_type"])


def hf_sources(cfg: GPTConfig, keys: Iterable[str]) -> Dict[str, HFSource]:
    """{tpflash key: its HFSource} for the given keys of a model of config `cfg` (e.g. the keys of
    `model.state_dict()`; non-persistent buffers are not among them)."""
    fam = hf_family(cfg)
    return {key: _source(fam, key) for key in keys}


def hf_tensor_names(cfg: GPTConfig, keys: Iterable[str]) -> Dict[str, List[Tuple[str, HFSource]]]:
    """{HF tensor name: [(tpflash key, source), ...]} in the order the tpflash keys come, for export:
    an HF tensor with several parts is the concatenation of its parts along dim 0 (then transposed).
    A tied model writes no lm_head.weight (transformers' save_pretrained drops tied weights too)."""
    out: Dict[str, List[Tuple[str, HFSource]]] = defaultdict(list)
    for key, src in hf_sources(cfg, keys).items():
        out[src.key].append((key, src))
    for parts in out.values():
        parts.sort(key=lambda ks: ks[1].part or (0, 1))
    return dict(out)


def hf_tensor(parts: List[Tuple[str, HFSource]], tensors: StateDict) -> torch.Tensor:
    """One HF tensor from the full tpflash tensors of its parts (see hf_tensor_names)."""
    pieces = [tensors[key] for key, _ in parts]
    t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    return (t.t() if parts[0][1].transpose else t).contiguous()


def to_tpflash_state_dict(hf: StateDict, cfg: GPTConfig, keys: Iterable[str]) -> StateDict:
    """The full tpflash state dict (the given keys) from a full HF state dict."""
    def lookup(name):
        return hf[name] if name in hf else hf[name.removeprefix("transformer.")]
    return {key: src.take(lookup(src.key)).contiguous() for key, src in hf_sources(cfg, keys).items()}


def to_hf_state_dict(full: StateDict, cfg: GPTConfig) -> StateDict:
    """The full HF state dict from a full tpflash one (lm_head.weight included, tied or not)."""
    out = {name: hf_tensor(parts, full) for name, parts in hf_tensor_names(cfg, full.keys()).items()}
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out[_source(hf_family(cfg), "tok_embeddings.weight").key]
    return out


# ---- in-memory conversion of transformers models --------------------------------------------------
def config_from_hf(hf_config) -> GPTConfig:
    """The GPTConfig of a transformers config object (ValueError for unsupported types or fields)."""
    return config_from_hf_dict(hf_config.to_dict())


def _meta_model(cfg: GPTConfig, process_group, dtype) -> GPT:
    with torch.device("meta"):  # skip the random init; every tensor is loaded afterwards
        model = GPT(cfg, process_group=process_group, dtype=dtype)
    return model.to_empty(device="cpu")


def from_hf(hf_model, process_group=None, sequence_parallel: bool = False, **overrides) -> GPT:
    """A tpflash GPT with the weights of an in-memory transformers causal LM (see hf_config for the
    supported model types), sharded for `process_group` (default: the default tp group, or tp=1).
    `overrides` replace GPTConfig fields (e.g. dropout). The model gets the HF weights' dtype, on CPU.
    No communication: every rank must hold the same HF model. To load from files without building a
    transformers model on every rank, use tpflash.models.from_pretrained (streaming, per-rank slices).
    """
    cfg = dataclasses.replace(config_from_hf(hf_model.config), sequence_parallel=sequence_parallel, **overrides)
    model = _meta_model(cfg, process_group, next(hf_model.parameters()).dtype)
    hf = {k: v.detach().cpu() for k, v in hf_model.state_dict().items()}
    load_full_state_dict(model, to_tpflash_state_dict(hf, cfg, model.state_dict().keys()))
    return model


def hf_transformers_config(cfg: GPTConfig):
    """The transformers config object of a tpflash config."""
    import transformers
    d = hf_config_dict(cfg)
    return transformers.AutoConfig.for_model(**d)


def to_hf(model: GPT):
    """The transformers model (on CPU, the model's dtype) holding `model`'s full weights.
    Collective over the model's tp group (and dp group under FSDP): call on all its ranks."""
    import transformers

    cfg = model.config
    full = full_state_dict(model, device=torch.device("cpu"))
    dtype = next(iter(full.values())).dtype
    hf = transformers.AutoModelForCausalLM.from_config(hf_transformers_config(cfg)).to(dtype)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(full, cfg), strict=False)
    missing = [k for k in missing if not k.endswith(".attn.bias") and not k.endswith(".attn.masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"to_hf: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    if cfg.tie_embeddings:
        hf.tie_weights()
    return hf.eval()
