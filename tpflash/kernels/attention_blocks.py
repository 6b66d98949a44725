"""Attention of one query block over one key/value block, with its log-sum-exp, as plain functions
(no autograd): the steps that ring attention (tpflash.parallel.context_attention) chains.

    out, lse = attention_block_forward(q, k, v, causal, scale)
    dq, dk, dv = attention_block_backward(q, k, v, out, lse, grad_out, causal, scale)

Blocks combine exactly: the attention of q over keys K1 ++ K2 is (o1, l1) and (o2, l2) merged as
l = logaddexp(l1, l2), o = o1 * exp(l1 - l) + o2 * exp(l2 - l). The backward takes the *merged*
out and lse of the rows, not the block's own: with those, exp(q k^T * scale - lse) are the true
probabilities restricted to this block and rowsum(grad_out * out) is the true correction term, so
the block's dq, dk, dv are exactly its share of the full gradient (flash attention's backward,
split by key block).

Shapes: q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k, heads_kv, head_dim] (any strides with
a contiguous last dim; heads_q % heads_kv == 0, kv never repeated in memory by the Triton kernels),
out like q, lse fp32 [batch, heads_q, seq_q] (a slice along seq_q is fine). causal is bottom-right
aligned, as flash_attention's. Triton on CUDA; plain PyTorch in fp32 elsewhere (and for head dims
the Triton kernels do not take). Results are in the inputs' dtype (Triton) or fp32 (PyTorch):
callers accumulate in fp32.
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import dispatch
from .reference import _attention_one

Tensor = torch.Tensor


def _use_triton(q: Tensor) -> bool:
    if dispatch.pick(q) != "triton":
        return False
    from .flash_attn import MAX_HEAD_DIM
    return q.shape[-1] <= MAX_HEAD_DIM


def attention_block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tuple[Tensor, Tensor]:
    """(out [batch, seq_q, heads_q, head_dim], lse fp32 [batch, heads_q, seq_q]) of q over this k/v block."""
    if _use_triton(q):
        from .flash_attn import AttnGeometry, attention_forward
        return attention_forward(q, k, v, causal, scale, AttnGeometry(q, k, None, None))
    with torch.no_grad():
        out, lse = _attention_one(q.float(), k.float(), v.float(), causal, scale)
    return out, lse


def attention_block_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                             causal: bool, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this block, shaped like q, k, v, given the rows' merged out and lse and grad_out
    (shaped like out)."""
    if _use_triton(q):
        from .flash_attn import AttnGeometry
        from .flash_attn_bwd import attention_backward
        # contiguous: the kernels index a scratch buffer made like lse with lse's strides
        return attention_backward(q, k, v, out, lse.contiguous(), grad_out, causal, scale,
                                  AttnGeometry(q, k, None, None))
    return _block_backward_reference(q, k, v, out, lse, grad_out, causal, scale)


@torch.no_grad()
def _block_backward_reference(q, k, v, out, lse, grad_out, causal, scale):
    batch, seq_k, heads_kv, head_dim = k.shape
    groups = q.shape[2] // heads_kv
    qf, do = q.float(), grad_out.float()
    kf, vf = k.float().repeat_interleave(groups, dim=2), v.float().repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale  # [b, hq, sq, sk]
    if causal:
        seq_q = q.shape[1]
        keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.exp(scores - lse.float()[..., None]).nan_to_num(0.0)  # rows with lse = -inf see no key
    delta = (do * out.float()).sum(-1).transpose(1, 2)  # [b, hq, sq]: rowsum(dO * O)
    d_scores = probs * (torch.einsum("bqhd,bkhd->bhqk", do, vf) - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", d_scores, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", d_scores, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, do)
    # each kv head served `groups` q heads: its gradient is their sum
    dk = dk.view(batch, seq_k, heads_kv, groups, head_dim).sum(3)
    dv = dv.view(batch, seq_k, heads_kv, groups, head_dim).sum(3)
    return dq, dk, dv
