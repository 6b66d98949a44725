"""Attention over a sequence spread across a context-parallel (cp) group: ring, or all-gathered k/v.

Every cp rank holds its queries, keys and values for seq/cp tokens of each sequence in the zigzag
layout (tpflash.parallel.zigzag: chunks r and 2cp-1-r). Two ways to attend over the whole sequence,
with the same result:

  ring       k/v travel around the ring (send to cp rank r+1, receive from r-1), each step's
             transfer in flight while the block in hand is computed; the blocks' partial outputs
             merge exactly through their log-sum-exp (tpflash.kernels.attention_blocks). The backward
             runs the ring again and passes each kv block's dk/dv accumulator along with it, so
             that it arrives back at its owner after a full turn. No rank ever holds more than two
             kv blocks: memory per rank falls as 1/cp.
  allgather  all-gather k/v over cp (reduce-scatter of their gradient in backward), then two flash
             attention calls per rank (one per chunk, against the keys up to it). Fewer, larger
             kernels and one collective; holds the whole sequence's k/v. For short sequences.

Causal, zigzag: with a = this rank's chunks (r, 2cp-1-r) and the kv block of rank s,
    s == r: causal attention of the local block on itself (the positions are increasing in it);
    s <  r: every local query sees the first kv chunk (s) whole and nothing of the second;
    s >  r: only the second local chunk (2cp-1-r) sees anything, and it sees the whole kv block.
So every step but the first is half a block: the ranks do the same work.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import kernels
from ..kernels.attention_blocks import attention_block_backward, attention_block_forward
from .comm import all_gather_along_seq
from .zigzag import natural_order

CP_COMMS = ("ring", "allgather")
_KV_TAG, _GRAD_TAG = 11, 12  # kv and dk/dv accumulators can be in flight between the same ranks at once


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Optional[dist.ProcessGroup],
                               *, causal: bool = True, softmax_scale: Optional[float] = None,
                               cp_comm: str = "ring") -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, for this cp rank's queries.

    q [batch, seq/cp, heads_q, head_dim], k/v [batch, seq/cp, heads_kv, head_dim]: this rank's tokens in
    the zigzag layout (heads_q % heads_kv == 0; GQA is never expanded in memory). seq/cp must be even
    (two chunks). Returns out like q (the same tokens). Differentiable in q, k, v. cp_group: the cp
    ranks of this sequence (None or a group of one: plain flash attention). Every rank of the group
    must call it with equal shapes; the shapes are checked before any communication.
    """
    if cp_comm not in CP_COMMS:
        raise ValueError(f"cp_comm={cp_comm!r} must be one of {CP_COMMS}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cp_group is None or cp_group.size() == 1:
        return kernels.flash_attention(q, k, v, causal=causal, softmax_scale=scale)
    _check_inputs(q, k, v)
    if cp_comm == "allgather":
        return _allgather_attention(q, k, v, cp_group, causal, scale)
    return _RingAttention.apply(q, k, v, cp_group, causal, scale)


def _check_inputs(q, k, v) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [batch, seq/cp, "
                         "heads_q, head_dim] and k, v [batch, seq/cp, heads_kv, head_dim]")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, seq/cp and head_dim, and "
                         "heads_q must be a multiple of heads_kv")
    if q.shape[1] % 2:
        raise ValueError(f"this rank's sequence length {q.shape[1]} must be even (two zigzag chunks)")


def ring_blocks(rank: int, src: int, local: int, causal: bool) -> List[Tuple[slice, slice, bool]]:
    """(query rows, kv rows, causal) of the attention this rank computes against the kv block of cp rank src."""
    every, first, second = slice(0, local), slice(0, local // 2), slice(local // 2, local)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]
    if src < rank:
        return [(every, first, False)]
    return [(second, every, False)]


class _Ring:
    """Shift a tensor one step around the cp ring: send to rank r+1, receive from r-1 (asynchronous)."""

    def __init__(self, group: dist.ProcessGroup):
        rank, size = group.rank(), group.size()
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self.group = group

    def shift(self, x: torch.Tensor, tag: int):
        """Start sending x on; returns a handle whose wait() gives what the previous rank sent."""
        received = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])
        return _Pending(works, received)


class _Pending:
    def __init__(self, works, result):
        self.works, self.result = works, result

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.result


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running fp32 (out [b, s, h, d], lse [b, h, s]) views, in place."""
    merged = torch.logaddexp(lse, block_lse)
    keep, take = torch.exp(lse - merged), torch.exp(block_lse - merged)  # [b, h, s]
    out.mul_(keep.transpose(1, 2)[..., None]).add_(block_out.float() * take.transpose(1, 2)[..., None])
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    """Ring attention over cp_group (module docstring); q/k/v in the zigzag layout."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        ring, rank, cp, local = _Ring(group), group.rank(), group.size(), q.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [b, s/cp, hq, d]
        lse = torch.full((q.shape[0], q.shape[2], local), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # [2, b, s/cp, hkv, d]: one transfer per step
        for step in range(cp):
            incoming = ring.shift(kv, _KV_TAG) if step + 1 < cp else None
            src = (rank - step) % cp
            for rows, cols, block_causal in ring_blocks(rank, src, local, causal):
                block_out, block_lse = attention_block_forward(q[:, rows], kv[0][:, cols], kv[1][:, cols],
                                                               block_causal, scale)
                _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
            if incoming is not None:
                kv = incoming.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        ring, rank, cp, local = _Ring(group), group.rank(), group.size(), q.shape[1]
        grad_out = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        travelling = None  # the dk/dv accumulator of the kv block in hand, from the previous rank
        for step in range(cp):
            incoming = ring.shift(kv, _KV_TAG) if step + 1 < cp else None
            src = (rank - step) % cp
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # this rank's share, [2, b, s/cp, hkv, d]
            for rows, cols, block_causal in ring_blocks(rank, src, local, causal):
                dq_block, dk_block, dv_block = attention_block_backward(
                    q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows], grad_out[:, rows],
                    block_causal, scale)
                dq[:, rows] += dq_block
                dkv[0][:, cols] += dk_block
                dkv[1][:, cols] += dv_block
            if travelling is not None:
                dkv += travelling.wait()
            # on to the next rank; after the last step that is the block's owner (src = rank + 1)
            travelling = ring.shift(dkv, _GRAD_TAG)
            if incoming is not None:
                kv = incoming.wait()
        dkv = travelling.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _allgather_attention(q, k, v, group, causal, scale) -> torch.Tensor:
    """All-gather k/v over cp, put the chunks in sequence order, attend chunk by chunk (module docstring)."""
    rank, cp, local = group.rank(), group.size(), q.shape[1]
    chunk = local // 2
    kv = torch.stack([k, v], dim=2)  # [b, s/cp, 2, hkv, d]
    gathered = all_gather_along_seq(kv, group, seq_dim=1)  # [b, s, 2, hkv, d], rank order
    order = torch.tensor(natural_order(cp), device=q.device)
    by_chunk = gathered.unflatten(1, (2 * cp, chunk))  # [b, 2cp, c, 2, hkv, d]
    kv_all = by_chunk.index_select(1, order).flatten(1, 2)  # [b, s, 2, hkv, d], natural order
    k_all, v_all = kv_all[:, :, 0], kv_all[:, :, 1]
    if not causal:
        return kernels.flash_attention(q, k_all, v_all, causal=False, softmax_scale=scale)
    outs = []
    for rows, index in ((slice(0, chunk), rank), (slice(chunk, local), 2 * cp - 1 - rank)):
        seen = (index + 1) * chunk  # keys up to the end of this chunk; bottom-right causal alignment
        outs.append(kernels.flash_attention(q[:, rows], k_all[:, :seen], v_all[:, :seen], causal=True,
                                            softmax_scale=scale))
    return torch.cat(outs, dim=1)
