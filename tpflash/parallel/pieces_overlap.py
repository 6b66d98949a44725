"""The "pieces" overlap backend: sequence-parallel GEMMs with NCCL/gloo collectives per piece.

Under sequence parallelism a column-parallel GEMM needs the all-gathered input and a
row-parallel GEMM ends in a reduce-scatter. Here each rank's sequence shard is cut into k pieces
(rows [j*m, (j+1)*m) of its [s/tp, b, feat] block, m = s/(tp*k)), and every piece is its own
asynchronous NCCL/gloo collective, so that the GEMM on one piece runs while the next piece travels:

  pipelined_all_gather      all-gather piece j of every rank ([tp, m, ...]) and hand it to the
                            consumer as soon as it has arrived, while pieces j+1.. are in flight.
  pipelined_reduce_scatter  compute this rank's contribution to piece j of every rank's rows
                            ([tp, m, ...]) and reduce-scatter it while piece j+1 is computed.

Viewing a sequence-first tensor of all tokens as [tp, k, m, feat], piece j is the strided slice
[:, j]: the GEMMs read and write it as a strided batch of tp matrices, with no copies.

Backward reuses the pair (the gradient of a gather is a reduce-scatter and vice versa):
  column: grad_x = pipelined_reduce_scatter(grad_y @ W) runs while the weight-gradient GEMM
          grad_W = grad_y^T x_full is computed; if the forward kept only the local input shard,
          its all-gather is issued first and hides behind the input-gradient GEMMs.
  row:    grad_h = pipelined_all_gather(grad_y) @ W, each piece multiplied on arrival.

On CUDA the collectives run on NCCL's own stream; `Work.wait()` makes the compute stream wait on
an event, so the GEMM of piece j runs while piece j+1 is in flight. On CPU/gloo the same code runs
with asynchronous work handles, which is what the tests exercise. (A first version passed whole
tp-chunks around a ring of NCCL send/recv; on 2 H200s it was slower than no overlap at all, see
docs/overlap.md, so pieces go through NCCL's collectives.) Which backend runs, and when overlap is
on at all, is tpflash.parallel.overlap's business. Process group: the tp group passed in.
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..layers.weight_casts import stacked_cast
from . import comm
from .overlap import _cast, _no_autocast, _rows, linear_compute_dtype


def num_pieces(rows: int, want: Optional[int] = None) -> int:
    """k: the largest divisor of `rows` (this rank's sequence length) not above `want`
    (default TPFLASH_OVERLAP_PIECES, else 4)."""
    want = int(os.environ.get("TPFLASH_OVERLAP_PIECES", "4")) if want is None else want
    return max(d for d in range(1, max(1, min(want, rows)) + 1) if rows % d == 0)


# ---- pipelined collectives ------------------------------------------------------------------------

def pipelined_all_gather(x_local: torch.Tensor, group, pieces: int,
                         on_piece: Callable[[int, torch.Tensor], None], keep: bool = True) -> Optional[torch.Tensor]:
    """All-gather `x_local` [n, ...] along dim 0 as `pieces` collectives (all issued at once), calling
    on_piece(j, gathered) with gathered = piece j of every rank, [world, n/pieces, ...], as soon as it
    has arrived. Returns the gathered [world*n, ...] in rank (sequence) order when `keep`."""
    world = dist.get_world_size(group)
    xp = x_local.contiguous().view((pieces, -1) + tuple(x_local.shape[1:]))  # [k, m, ...]
    bufs = [xp.new_empty((world * xp.shape[1],) + tuple(xp.shape[2:])) for _ in range(pieces)]  # [tp*m, ...]
    works = [comm.all_gather_single(buf, xp[j], group=group, async_op=True) for j, buf in enumerate(bufs)]
    bufs = [buf.view((world,) + tuple(xp.shape[1:])) for buf in bufs]  # [tp, m, ...]
    full = xp.new_empty((world,) + tuple(xp.shape)) if keep else None  # [tp, k, m, ...]
    for j, (buf, work) in enumerate(zip(bufs, works)):
        work.wait()
        on_piece(j, buf)
        if keep:
            full[:, j].copy_(buf)
    return None if full is None else full.view((-1,) + tuple(x_local.shape[1:]))


class PendingReduceScatter:
    """In-flight reduce-scatters of the pieces; `wait()` returns this rank's reduced rows."""

    def __init__(self, out: torch.Tensor, works, keep_alive):
        self._out, self._works, self._keep_alive = out, works, keep_alive

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._keep_alive = [], []
        return self._out


def pipelined_reduce_scatter(partial_for: Callable[[int], torch.Tensor], out: torch.Tensor, group,
                             pieces: int) -> PendingReduceScatter:
    """out[j] = sum over ranks of partial_for(j)[rank], for j < pieces: partial_for(j) is this rank's
    contribution to piece j of every rank's rows, [world, m, ...]; out is [pieces, m, ...]. Each piece's
    reduce-scatter is issued as soon as it is computed, so it travels while the next is computed;
    the caller can do more work before `wait()`."""
    works, partials = [], []
    for j in range(pieces):
        partials.append(partial_for(j).contiguous())  # [tp, m, ...], alive until the collective has read it
        works.append(comm.reduce_scatter_single(out[j], partials[-1].flatten(0, 1), group=group, async_op=True))
    return PendingReduceScatter(out, works, partials)


def _bmm_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
    """out[r] = a[r] @ w (+ bias) for every r: a [p, m, i], w [i, o], out [p, m, o] (possibly strided)."""
    w3 = w.unsqueeze(0).expand(a.shape[0], -1, -1)
    if bias is None:
        torch.bmm(a, w3, out=out)
    else:
        torch.baddbmm(bias.view(1, 1, -1).expand(out.shape), a, w3, out=out)


# ---- the two autograd Functions --------------------------------------------------------------------

class _AllGatherLinear(torch.autograd.Function):
    """ys_i = all_gather_seq(x_local) @ W_i^T + b_i for several weights sharing one gathered input.

    x_local [s/tp, b, in] -> ys_i [s, b, out_i/tp]. Forward: pipelined all-gather, each piece
    multiplied on arrival. Backward: pipelined reduce-scatter of grad_x = sum_i grad_y_i W_i, with
    the weight-gradient GEMMs done before it is awaited.
    """

    @staticmethod
    def forward(ctx, x_local, group, save_gathered, *params):
        n = len(params) // 2
        dtype = linear_compute_dtype(x_local)
        ctx.group, ctx.save_gathered, ctx.x_dtype = group, save_gathered, x_local.dtype
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.has_bias = [b is not None for b in params[n:]]
        x = x_local.to(dtype).contiguous()
        weights, biases = [stacked_cast([w], dtype) for w in params[:n]], [_cast(b, dtype) for b in params[n:]]
        world, k = dist.get_world_size(group), num_pieces(x.shape[0])
        ctx.pieces = k
        lead = (world * x.shape[0],) + tuple(x.shape[1:-1])
        outs = [x.new_empty(lead + (w.shape[0],)) for w in weights]  # [s, b, out_i/tp]
        out4 = [o.view(world, k, -1, o.shape[-1]) for o in outs]  # [tp, k, m, out_i/tp]

        def multiply(j: int, gathered: torch.Tensor) -> None:  # gathered: piece j of every rank [tp, m, in]
            for o, w, b in zip(out4, weights, biases):
                _bmm_into(o[:, j], gathered, w.t(), b)

        with _no_autocast(x):
            x_full = pipelined_all_gather(_rows(x), group, k, multiply, keep=save_gathered)  # [s*b, in]
        ctx.save_for_backward(x_full.view(lead + (x.shape[-1],)) if save_gathered else x, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_ys):
        x_saved, *weights = ctx.saved_tensors
        group, world, k = ctx.group, dist.get_world_size(ctx.group), ctx.pieces
        grads = [g.to(x_saved.dtype).contiguous() for g in grad_ys]  # [s, b, out_i/tp]
        local_rows = x_saved.shape[0] // world if ctx.save_gathered else x_saved.shape[0]
        local_shape = (local_rows,) + tuple(x_saved.shape[1:])  # [s/tp, b, in]
        with _no_autocast(x_saved):
            # the input for the weight gradient travels while the input-gradient GEMMs run
            gather = None if ctx.save_gathered else comm.all_gather_async(x_saved, 0, group)
            g4 = [g.view(world, k, -1, g.shape[-1]) for g in grads]  # [tp, k, m, out_i/tp]

            def grad_input_of(j: int) -> torch.Tensor:  # this rank's part of grad_x, piece j of all ranks
                acc = torch.bmm(g4[0][:, j], weights[0].unsqueeze(0).expand(world, -1, -1))
                for g, w in zip(g4[1:], weights[1:]):
                    acc.baddbmm_(g[:, j], w.unsqueeze(0).expand(world, -1, -1))
                return acc  # [tp, m, in]

            rows = local_shape[0] * (x_saved[0].numel() // x_saved.shape[-1])  # s/tp*b
            out = x_saved.new_empty((k, rows // k, x_saved.shape[-1]))  # this rank's grad_x, [k, m, in]
            pending = pipelined_reduce_scatter(grad_input_of, out, group, k)
            x_rows = _rows(x_saved if gather is None else gather.wait())  # [s*b, in]
            grad_ws = [_rows(g).t() @ x_rows for g in grads]  # runs while grad_x is reduce-scattered
            grad_bs = [_rows(g).sum(0) if has else None for g, has in zip(grads, ctx.has_bias)]
            grad_x = pending.wait()
        param_grads = [None if g is None else g.to(dt) for g, dt in zip(grad_ws + grad_bs, ctx.param_dtypes)]
        return (grad_x.view(local_shape).to(ctx.x_dtype), None, None, *param_grads)


class _LinearReduceScatter(torch.autograd.Function):
    """y_local = reduce_scatter_seq(h @ W^T): h [s, b, in/tp] -> y_local [s/tp, b, out].

    Forward: the partial product of each piece is reduce-scattered while the next is computed.
    Backward: grad_h = all_gather_seq(grad_y) @ W with each piece multiplied on arrival, then
    grad_W = grad_y_full^T h.
    """

    @staticmethod
    def forward(ctx, h, weight, group):
        dtype = linear_compute_dtype(h)
        ctx.group, ctx.dtypes = group, (h.dtype, weight.dtype)
        h, w = h.to(dtype).contiguous(), stacked_cast([weight], dtype)
        world = dist.get_world_size(group)
        k = ctx.pieces = num_pieces(h.shape[0] // world)
        h4 = h.view(world, k, -1, h.shape[-1])  # [tp, k, m, in/tp]
        w3 = w.t().unsqueeze(0).expand(world, -1, -1)  # [tp, in/tp, out], no copy
        out = h.new_empty((k, h4.shape[2], w.shape[0]))  # this rank's rows, piece by piece [k, m, out]
        with _no_autocast(h):
            y = pipelined_reduce_scatter(lambda j: torch.bmm(h4[:, j], w3), out, group, k).wait()
        ctx.save_for_backward(h, w)
        return y.view((h.shape[0] // world,) + tuple(h.shape[1:-1]) + (w.shape[0],))

    @staticmethod
    def backward(ctx, grad_y):
        h, w = ctx.saved_tensors
        world, k = dist.get_world_size(ctx.group), ctx.pieces
        grad_y = grad_y.to(h.dtype).contiguous()  # [s/tp, b, out]
        grad_h = h.new_empty(h.shape)  # [s, b, in/tp]
        gh4 = grad_h.view(world, k, -1, h.shape[-1])  # [tp, k, m, in/tp]

        def multiply(j: int, gathered: torch.Tensor) -> None:  # piece j of every rank's grad_y [tp, m, out]
            _bmm_into(gh4[:, j], gathered, w)

        with _no_autocast(h):
            grad_full = pipelined_all_gather(_rows(grad_y), ctx.group, k, multiply)  # [s*b, out]
            grad_w = grad_full.t() @ _rows(h)  # [out, in/tp]
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


# ---- entry points (called by tpflash.parallel.overlap, which checks the arguments) -------------------

def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Sequence[Optional[torch.Tensor]], group, save_gathered_input: bool) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i)], the gather pipelined piece by piece with the
    GEMMs: x_local [s/tp, b, in], W_i [out_i/tp, in] -> [s, b, out_i/tp] each."""
    return list(_AllGatherLinear.apply(x_local, group, save_gathered_input, *weights, *biases))


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """reduce_scatter_along_seq(F.linear(h, weight)), piece by piece: h [s, b, in/tp] -> [s/tp, b, out]."""
    return _LinearReduceScatter.apply(h, weight, group)
