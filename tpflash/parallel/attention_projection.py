"""Causal attention feeding the row-parallel output projection's reduce-scatter chunk by chunk.

On the overlapped path (tpflash.parallel.overlap) the output projection sends each peer its rows of
h @ W^T while it multiplies the next rows; but h, the attention's output, exists only once the whole
attention has run, so the transfers (tp-1 parts of [s/tp, b, hidden]) start after it and outlast the
projection's short GEMMs: at tp=4 the GPU waited for them in every block's forward
(docs/performance.md, "TP efficiency"). Here the attention runs by query chunks, one per rank
(tpflash.kernels.attention_chunks): each peer's rows of h are computed, multiplied and sent while
the next peer's are computed, this rank's own rows last.

  forward   for each peer r, in sending order: chunk r of the attention (its queries against the
            keys up to its last position), its rows multiplied and sent to r; then this rank's chunk
            and its GEMM (with the bias), and the sum (or its parts)
  backward  the row layer's (grad_y gathered, grad_h and grad_W: overlap_gemms.row_linear_backward),
            then the attention's over the whole sequence from the assembled output and log-sum-exp

What it computes is what attention followed by `linear_reduce_scatter` computes, up to the order of
floating-point sums. Process group: the tp group passed in.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..kernels.attention_chunks import ChunkedCausalAttention, causal_attention_backward
from ..layers.main_grads import main_grad_of
from ..layers.weight_casts import stacked_cast
from .held_work import HeldWork
from . import overlap_gemms
from .overlap_gemms import _no_autocast, _rows, linear_compute_dtype, row_linear_backward
from .state import group_size


class _AttentionThenRowLinear(torch.autograd.Function):
    """y_local = reduce_scatter_seq(attention(q, k, v) @ W^T) + b: q [s, b, hq, d], k/v [s, b, hkv, d]
    (seq-first, this rank's heads) -> y_local [s/tp, b, out], a tuple of one tensor or of `parts`
    as `_RowLinearOverPeers` returns them."""

    @staticmethod
    def forward(ctx, q, k, v, weight, bias, scale, backend, group, held, parts):
        dtype = linear_compute_dtype(q)
        ctx.group, ctx.held, ctx.scale, ctx.backend = group, held, scale, backend
        ctx.dtypes = (q.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.kv_dtypes = (k.dtype, v.dtype)
        ctx.main_grad = main_grad_of([weight])  # where the weight gradient is added (tpflash.layers.main_grads)
        world = dist.get_world_size(group)
        s, b, hq, d = q.shape
        with _no_autocast(q):
            attn = ChunkedCausalAttention(q.to(dtype), k.to(dtype), v.to(dtype), world, scale, backend)
            w = stacked_cast([weight], dtype)  # [out, hq*d]
            b_c = None if bias is None else stacked_cast([bias], dtype)
            h = attn.out.view(s, b, hq * d)  # filled chunk by chunk: attn.rows(r) before rank r's rows are read
            ys = overlap_gemms._multiply_scatter(_rows(h), w.t(), group, b_c, held, parts, produce=attn.rows)
        ctx.save_for_backward(attn.q, attn.k, attn.v, h, attn.lse, w)
        ys = tuple(y.view(s // world, b, w.shape[0]) for y in ys)
        ctx.mark_non_differentiable(*ys[1:])  # other ranks' parts: their gradients are theirs to compute
        return ys

    @staticmethod
    def backward(ctx, grad_y, *_received):
        q, k, v, h, lse, w = ctx.saved_tensors
        grad_h, grad_w, grad_b = row_linear_backward(ctx, grad_y, h, w, ctx.needs_input_grad[4])
        with _no_autocast(q):
            dq, dk, dv = causal_attention_backward(q, k, v, h.view(q.shape), lse, grad_h.view(q.shape), ctx.scale,
                                                   ctx.backend)
        (q_dtype, *_), (k_dtype, v_dtype) = ctx.dtypes, ctx.kv_dtypes
        return dq.to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), grad_w, grad_b, None, None, None, None, None


def attention_reduce_scatter(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, weight: torch.Tensor,
                             group, backend: str, bias: Optional[torch.Tensor] = None,
                             held: Optional[HeldWork] = None,
                             parts: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """reduce_scatter_along_seq(causal_attention(q, k, v) @ weight^T) + bias, the attention computed by
    query chunks so that each rank's rows travel while the next are computed (module docstring).

    q [s, b, hq, d], k/v [s, b, hkv, d] (seq-first, this rank's heads; GQA: q head h reads kv head
    h // (hq/hkv)); causal, softmax scale `scale`; weight [out, hq*d] (the output projection's shard),
    bias [out] or None, held and parts as `overlap.linear_reduce_scatter`'s; backend: "triton" or
    "reference" (kernels.attention_chunks.chunked_attention_backend). Returns this rank's tokens
    [s/tp, b, out] (or the parts of that sum). Raises ValueError, before any collective, when s is not
    divisible by tp or the weight does not take hq*d features. Process group: `group` (tp > 1).
    """
    world = group_size(group)
    if world < 2:
        raise ValueError(f"attention_reduce_scatter needs a group of 2 or more ranks, got {world}")
    s, _, hq, d = q.shape
    if s % world:
        raise ValueError(f"sequence length {s} (dim 0 of q {tuple(q.shape)}) is not divisible by tp={world}")
    if weight.shape[1] != hq * d:
        raise ValueError(f"weight {tuple(weight.shape)} does not take the attention's {hq} heads x {d} features")
    ys = _AttentionThenRowLinear.apply(q, k, v, weight, bias, scale, backend, group, held, parts)
    return ys if len(ys) > 1 else ys[0]
