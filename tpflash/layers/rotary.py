"""Rotary position embeddings (RoPE), in the non-interleaved ("rotate half") layout Llama uses, with the
frequency scalings Hugging Face transformers gives Llama-family models.

`scaling` is None (plain RoPE) or a dict in transformers' `rope_parameters` names (without rope_theta):
  linear    {"factor"}: every inverse frequency divided by factor.
  dynamic   {"factor"}: NTK-aware; a forward over L > max_positions positions uses the base
            theta * (factor * L / max_positions - (factor - 1)) ** (d / (d - 2)).
  llama3    {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}:
            long wavelengths divided by factor, short ones kept, a smooth ramp in between.
  yarn      {"factor", "original_max_position_embeddings", optional "attention_factor", "beta_fast",
            "beta_slow", "mscale", "mscale_all_dim", "truncate"}: interpolation blended with
            extrapolation per frequency, cos/sin scaled by attention_factor.
  longrope  {"short_factor", "long_factor", "original_max_position_embeddings", optional "factor",
            "attention_factor"}: per-frequency divisors, the long set for forwards longer than
            original_max_position_embeddings; cos/sin scaled by attention_factor.
The formulas follow transformers' modeling_rope_utils (v5) step for step, in fp32, so that tables agree
with its to rounding. "Length" for dynamic and longrope is what transformers takes, max(position) + 1.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from .. import kernels

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}
_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
             "longrope": ("factor", "attention_factor")}


def rope_keys(rope_type: str) -> Tuple[str, ...]:
    """The rope-parameter keys (transformers' names) that rope_type reads."""
    return _REQUIRED.get(rope_type, ()) + _OPTIONAL.get(rope_type, ())


def check_rope_scaling(scaling: Optional[Dict[str, Any]], head_dim: int) -> None:
    """Raise ValueError naming the value unless `scaling` is None or a supported rope scaling dict."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_type={kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    missing = [k for k in _REQUIRED.get(kind, ()) if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_type={kind!r} needs rope parameter(s) {missing}")
    unknown = sorted(set(scaling) - {"rope_type", *rope_keys(kind)})
    if unknown:
        raise ValueError(f"rope parameter(s) {unknown} are not used by rope_type={kind!r}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != head_dim // 2:
                raise ValueError(f"longrope {key} has {len(scaling[key])} entries; expected head_dim/2={head_dim // 2}")


def _plain_inv_freq(dim: int, base) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(dim: int, theta: float, p: Dict[str, Any]) -> torch.Tensor:
    inv_freq = _plain_inv_freq(dim, theta)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, p: Dict[str, Any], max_positions: int) -> Tuple[torch.Tensor, float]:
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    factor = max_positions / old_len if factor is None else factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = float(mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]))
        else:
            attention = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):  # the dimension at which a frequency turns `rotations` times in old_len
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _longrope(dim: int, theta: float, p: Dict[str, Any], max_positions: int, length: int):
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor")
    factor = max_positions / old_len if factor is None else factor
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(p["long_factor"] if length > old_len else p["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention


def _dynamic(dim: int, theta: float, p: Dict[str, Any], max_positions: int, length: int) -> torch.Tensor:
    if length <= max_positions:  # transformers keeps the unscaled frequencies up to max_positions
        return _plain_inv_freq(dim, theta)
    factor = p["factor"]
    seq = torch.tensor(length, dtype=torch.int64)  # transformers computes the new base as a tensor, in fp32
    base = theta * ((factor * seq / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return _plain_inv_freq(dim, base)


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[Dict[str, Any]], max_positions: int,
                        length: int) -> Tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32 on CPU, attention scaling of cos/sin) for a forward over `length`
    positions (only dynamic and longrope depend on it) of a model of `max_positions` positions."""
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "default":
        return _plain_inv_freq(head_dim, theta), 1.0
    if kind == "linear":
        return _plain_inv_freq(head_dim, theta) / scaling["factor"], 1.0
    if kind == "dynamic":
        return _dynamic(head_dim, theta, scaling, max_positions, length), 1.0
    if kind == "llama3":
        return _llama3(head_dim, theta, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_positions)
    return _longrope(head_dim, theta, scaling, max_positions, length)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position-dependent angles: pair (x[i], x[i + d/2]) at position t turns by
    t * inv_freq[i] (theta^(-2i/d) for plain RoPE; `scaling` as in the module docstring), and cos/sin
    are multiplied by the scaling's attention factor (yarn, longrope). cos/sin tables are fp32 (the
    kernel rotates in fp32 whatever q's dtype), cached per (length, device); they are not parameters
    or buffers, so `model.to(bf16)` cannot round the angles. `max_positions`: the model's
    max_position_embeddings (dynamic, and longrope/yarn without an explicit factor).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Optional[Dict[str, Any]] = None,
                 max_positions: int = 2048):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        check_rope_scaling(scaling, head_dim)
        self.head_dim, self.theta, self.scaling, self.max_positions = head_dim, theta, scaling, max_positions
        self._tables: Dict[Tuple, Tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length_dependent(self) -> bool:
        """Whether the angles depend on the forward's length (dynamic and longrope scaling), not only
        on the positions: other kinds can read any length's table at positions below that length."""
        return self.scaling is not None and self.scaling["rope_type"] in ("dynamic", "longrope")

    def tables(self, seq_len: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [seq_len, head_dim/2] fp32, for positions 0..seq_len-1 of a forward whose
        length (max position + 1) is seq_len."""
        key = (seq_len, device)
        if key not in self._tables:
            inv_freq, attention = inverse_frequencies(self.head_dim, self.theta, self.scaling, self.max_positions,
                                                      seq_len)
            angles = torch.outer(torch.arange(seq_len, dtype=torch.int64).float(), inv_freq).to(device)
            cos, sin = angles.cos(), angles.sin()
            if attention != 1.0:
                cos, sin = cos * attention, sin * attention
            self._tables = {key: (cos, sin)}  # keep one length only
        return self._tables[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Without position_ids: q [batch, seq, heads_q, head_dim], k [batch, seq, heads_kv, head_dim]
        at positions 0..seq-1. With position_ids [tokens] (int64, position of each token): q/k
        [tokens, heads, head_dim], and `length` the forward's max position + 1 (default: tokens).
        Returns the rotated (q, k)."""
        if position_ids is None:
            cos, sin = self.tables(q.shape[1], q.device)
        else:
            # Packed batches change their longest document every step; a table per length would be
            # rebuilt (and copied to the device) in every layer every step where the angles do not
            # depend on the length: there, one table of the tokens' count serves every batch (or of
            # `length`, where positions run past the token count: a context-parallel rank's tokens).
            rows = length if self.length_dependent and length else max(q.shape[0], length or 0)
            cos, sin = self.tables(rows, q.device)
            cos, sin = cos[position_ids], sin[position_ids]  # [tokens, head_dim/2]
        return kernels.apply_rotary(q, cos, sin), kernels.apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"
