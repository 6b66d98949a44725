"""Public flash attention: input checks and the choice between the Triton kernel and the reference."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import dispatch
from .reference import attention_reference


def _check_attention_inputs(q, k, v, cu_seqlens, max_seqlen) -> None:
    packed = cu_seqlens is not None
    want = 3 if packed else 4
    layout = "[total, heads, head_dim] (varlen)" if packed else "[batch, seq, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {layout}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride {t.stride(-1)})")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim={q.shape[-1]} != k head_dim={k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"heads_q={q.shape[-2]} is not divisible by heads_kv={k.shape[-2]}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch={q.shape[0]} != k batch={k.shape[0]}")
    if packed:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with n_seqs+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"cu_seqlens dtype {cu_seqlens.dtype} must be torch.int32")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"varlen q total={q.shape[0]} != k total={k.shape[0]} (one cu_seqlens for both)")
        if max_seqlen is not None and max_seqlen < 1:
            raise ValueError(f"max_seqlen={max_seqlen} must be >= 1")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                    max_seqlen: Optional[int] = None, return_lse: bool = False):
    """Exact attention softmax(q k^T * softmax_scale) v without materialising the scores.

    q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k, heads_kv, head_dim], any strides with a
    contiguous last dim; heads_q % heads_kv == 0 (GQA/MQA: q head h reads kv head h // (heads_q/heads_kv),
    kv is never repeated in memory). causal: query i sees keys j <= i + seq_k - seq_q (bottom-right,
    as flash-attn). softmax_scale defaults to 1/sqrt(head_dim).
    Varlen (packed sequences): q/k/v [total, heads, head_dim] and cu_seqlens int32 [n_seqs + 1]
    (offsets of each sequence, the same for q and k); max_seqlen = the longest sequence (computed
    when omitted, at the cost of a device sync).
    Returns out shaped like q (its dtype; contiguous), and with return_lse also the fp32 log-sum-exp of
    the scaled scores, [batch, heads_q, seq_q] (varlen: [heads_q, total]). Differentiable in q, k, v.
    """
    _check_attention_inputs(q, k, v, cu_seqlens, max_seqlen)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if dispatch.pick(q) == "triton":
        from .flash_attn import triton_flash_attention
        out, lse = triton_flash_attention(q, k, v, causal, scale, cu_seqlens, max_seqlen)
        return (out, lse) if return_lse else out
    return attention_reference(q, k, v, causal, scale, cu_seqlens, max_seqlen, return_lse=return_lse)
