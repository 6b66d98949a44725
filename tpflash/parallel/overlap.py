"""Sequence-parallel GEMMs with their collectives pipelined (chunked collective-matmul).

Under sequence parallelism a column-parallel GEMM needs the all-gathered input and a
row-parallel GEMM ends in a reduce-scatter. Done naively the GPU waits for each collective.
Here both are cut into tp chunks along the sequence (chunk c = rows [c*s/tp, (c+1)*s/tp) of a
sequence-first [seq, batch, feat] tensor, the block rank c owns) and passed around a ring of
point-to-point transfers, so that while one chunk travels the previous one is multiplied:

  ring_all_gather      the input arrives chunk by chunk (own chunk first); each is multiplied
                       as soon as it is there, and lands in its slot of the gathered buffer.
  ring_reduce_scatter  the partial product of chunk c is computed just before it is needed:
                       rank r adds its partial for chunk c to the running sum received from
                       rank r+1 and sends it on to rank r-1; the sum ends at rank c.

Backward reuses the pair (the gradient of a gather is a reduce-scatter and vice versa):
  column: grad_x = ring_reduce_scatter(grad_y @ W) runs while the weight-gradient GEMM
          grad_W = grad_y^T x_full is computed (its last transfer waits behind it); if the forward
          kept only the local input shard, its all-gather is issued first and hides behind the
          input-gradient GEMMs.
  row:    grad_h = ring_all_gather(grad_y) @ W, each chunk multiplied on arrival.

On CUDA the transfers run on NCCL's own stream (the "side stream"); `Work.wait()` makes the
compute stream wait on an event, so the GEMM of chunk i runs while chunk i+1 is in flight. On
CPU/gloo the same code runs with asynchronous work handles, which is what the tests exercise.

The switch: `overlap_enabled()` is on unless TPFLASH_OVERLAP=0, and `overlap_comm(False)`
turns it off inside a `with` block; layers built with `overlap=None` ask at every forward.
Results are the same either way up to the order of floating-point sums.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import comm

_ENV = "TPFLASH_OVERLAP"
_forced: List[bool] = []  # stack of `overlap_comm` settings; the innermost wins


def overlap_enabled() -> bool:
    """Whether layers with overlap=None pipeline their collectives: the innermost `overlap_comm`
    setting, else the environment variable TPFLASH_OVERLAP ("0"/"false"/"off" disable), else on."""
    if _forced:
        return _forced[-1]
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def overlap_comm(enabled: bool = True):
    """Within the block, layers built with overlap=None use (or, with False, skip) the pipelined path."""
    _forced.append(bool(enabled))
    try:
        yield
    finally:
        _forced.pop()


def resolve_overlap(flag: Optional[bool]) -> bool:
    """A layer's explicit `overlap` flag, or the global setting when it is None."""
    return overlap_enabled() if flag is None else bool(flag)


# ---- ring transfers --------------------------------------------------------------------------------

def _ring_peers(group):
    """(rank, world, global rank of the next ring member, global rank of the previous one)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prev = dist.get_global_rank(group, (rank - 1) % world)
    return rank, world, nxt, prev


def _shift(send: torch.Tensor, recv: torch.Tensor, to_rank: int, from_rank: int, group):
    """Send `send` to one ring neighbour and receive `recv` from the other, as one batch (NCCL
    groups the pair, so two ranks exchanging with each other cannot deadlock). Returns the works."""
    ops = [dist.P2POp(dist.isend, send, to_rank, group), dist.P2POp(dist.irecv, recv, from_rank, group)]
    return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def ring_all_gather(x_local: torch.Tensor, group, on_chunk: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
    """All-gather `x_local` [n, ...] along dim 0 around the ring, calling on_chunk(src, chunk) for
    each rank's chunk as soon as it has arrived (this rank's own first, then src = r-1, r-2, ...),
    while the next chunk is in flight. Returns the gathered [world*n, ...] in rank order."""
    rank, world, nxt, prev = _ring_peers(group)
    full = x_local.new_empty((world,) + tuple(x_local.shape))  # [world, n, ...]
    full[rank].copy_(x_local)
    for step in range(world):
        src = (rank - step) % world  # the chunk this rank holds now
        works = []
        if step < world - 1:  # pass it on; receive the one the previous rank holds
            works = _shift(full[src], full[(src - 1) % world], nxt, prev, group)
        on_chunk(src, full[src])
        _wait(works)
    return full.flatten(0, 1)


class PendingReduceScatter:
    """The last hop of a ring reduce-scatter: `wait()` returns this rank's reduced chunk."""

    def __init__(self, partial: torch.Tensor, received: Optional[torch.Tensor], works):
        self._partial, self._received, self._works = partial, received, works

    def wait(self) -> torch.Tensor:
        if self._received is not None:
            _wait(self._works)
            self._partial += self._received
            self._received = None
        return self._partial


def ring_reduce_scatter(partial_for: Callable[[int], torch.Tensor], group) -> PendingReduceScatter:
    """Sum over the group of the tensors partial_for(c) (this rank's contribution to chunk c) and keep
    chunk `rank`. Each partial is computed just before it joins the ring, so the computation of the
    next chunk overlaps the transfer of the previous sum. The final hop is left pending: the caller
    can do more work before `wait()`."""
    rank, world, nxt, prev = _ring_peers(group)
    received, works = None, []
    for step in range(world):
        chunk = (rank + step + 1) % world  # the same chunk rank+1 worked on one step earlier
        partial = partial_for(chunk)
        if step == world - 1:  # chunk == rank: ours
            return PendingReduceScatter(partial, received, works)
        if received is not None:
            _wait(works)
            partial += received
        received = torch.empty_like(partial)
        works = _shift(partial, received, prev, nxt, group)
    raise AssertionError("unreachable")


# ---- dtype handling under autocast -----------------------------------------------------------------

def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: the autocast dtype when autocast is on, else x's."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and x.is_floating_point():
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[*, feat] -> [rows, feat] (a view when t is contiguous)."""
    return t.reshape(-1, t.shape[-1])


def _no_autocast(x: torch.Tensor):
    return torch.autocast(x.device.type, enabled=False)


# ---- the two autograd Functions --------------------------------------------------------------------

class _AllGatherLinear(torch.autograd.Function):
    """ys_i = all_gather_seq(x_local) @ W_i^T + b_i for several weights sharing one gathered input.

    x_local [s/tp, b, in] -> ys_i [s, b, out_i/tp]. Forward: ring all-gather, each chunk multiplied
    on arrival. Backward: ring reduce-scatter of grad_x = sum_i grad_y_i W_i, chunk by chunk, with
    the weight-gradient GEMMs done before its last hop is awaited.
    """

    @staticmethod
    def forward(ctx, x_local, group, save_gathered, *params):
        n = len(params) // 2
        dtype = _compute_dtype(x_local)
        ctx.group, ctx.save_gathered, ctx.x_dtype = group, save_gathered, x_local.dtype
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.has_bias = [b is not None for b in params[n:]]
        x = x_local.to(dtype).contiguous()
        weights, biases = [w.to(dtype) for w in params[:n]], [_cast(b, dtype) for b in params[n:]]
        world = dist.get_world_size(group)
        lead = (world * x.shape[0],) + tuple(x.shape[1:-1])
        outs = [x.new_empty(lead + (w.shape[0],)) for w in weights]  # [s, b, out_i/tp]
        out_chunks = [o.view(world, -1, o.shape[-1]) for o in outs]  # [tp, s/tp*b, out_i/tp]

        def multiply(src: int, chunk: torch.Tensor) -> None:  # chunk [s/tp, b, in] from rank src
            rows = _rows(chunk)
            for out, w, b in zip(out_chunks, weights, biases):
                if b is None:
                    torch.mm(rows, w.t(), out=out[src])
                else:
                    torch.addmm(b, rows, w.t(), out=out[src])

        with _no_autocast(x):
            x_full = ring_all_gather(x, group, multiply)  # [s, b, in]
        ctx.save_for_backward(x_full if save_gathered else x, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_ys):
        x_saved, *weights = ctx.saved_tensors
        group, world = ctx.group, dist.get_world_size(ctx.group)
        grads = [g.to(x_saved.dtype).contiguous() for g in grad_ys]  # [s, b, out_i/tp]
        with _no_autocast(x_saved):
            # the input for the weight gradient travels while the input-gradient GEMMs run
            gather = None if ctx.save_gathered else comm.all_gather_async(x_saved, 0, group)
            chunks = [g.view(world, -1, g.shape[-1]) for g in grads]  # [tp, s/tp*b, out_i/tp]

            def grad_input_of(c: int) -> torch.Tensor:  # this rank's part of grad_x for chunk c
                acc = torch.mm(chunks[0][c], weights[0])
                for g, w in zip(chunks[1:], weights[1:]):
                    acc.addmm_(g[c], w)
                return acc  # [s/tp*b, in]

            pending = ring_reduce_scatter(grad_input_of, group)
            x_rows = _rows(x_saved if gather is None else gather.wait())  # [s*b, in]
            grad_ws = [_rows(g).t() @ x_rows for g in grads]  # hides the last hop of grad_x
            grad_bs = [_rows(g).sum(0) if has else None for g, has in zip(grads, ctx.has_bias)]
            grad_x = pending.wait()
        local_rows = x_saved.shape[0] // world if ctx.save_gathered else x_saved.shape[0]
        local_shape = (local_rows,) + tuple(x_saved.shape[1:])  # [s/tp, b, in]
        param_grads = [None if g is None else g.to(dt) for g, dt in zip(grad_ws + grad_bs, ctx.param_dtypes)]
        return (grad_x.view(local_shape).to(ctx.x_dtype), None, None, *param_grads)


class _LinearReduceScatter(torch.autograd.Function):
    """y_local = reduce_scatter_seq(h @ W^T): h [s, b, in/tp] -> y_local [s/tp, b, out].

    Forward: the partial product of each chunk is computed just before it joins the ring.
    Backward: grad_h = all_gather_seq(grad_y) @ W with each chunk multiplied on arrival, then
    grad_W = grad_y_full^T h.
    """

    @staticmethod
    def forward(ctx, h, weight, group):
        dtype = _compute_dtype(h)
        ctx.group, ctx.dtypes = group, (h.dtype, weight.dtype)
        h, w = h.to(dtype).contiguous(), weight.to(dtype)
        world = dist.get_world_size(group)
        chunks = h.view(world, -1, h.shape[-1])  # [tp, s/tp*b, in/tp]
        with _no_autocast(h):
            y = ring_reduce_scatter(lambda c: chunks[c] @ w.t(), group).wait()  # [s/tp*b, out]
        ctx.save_for_backward(h, w)
        return y.view((h.shape[0] // world,) + tuple(h.shape[1:-1]) + (w.shape[0],))

    @staticmethod
    def backward(ctx, grad_y):
        h, w = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        grad_y = grad_y.to(h.dtype).contiguous()  # [s/tp, b, out]
        grad_h = h.new_empty(h.shape)  # [s, b, in/tp]
        grad_h_chunks = grad_h.view(world, -1, h.shape[-1])

        def multiply(src: int, chunk: torch.Tensor) -> None:  # grad_y chunk [s/tp, b, out] from rank src
            torch.mm(_rows(chunk), w, out=grad_h_chunks[src])

        with _no_autocast(h):
            grad_full = ring_all_gather(grad_y, ctx.group, multiply)  # [s, b, out]
            grad_w = _rows(grad_full).t() @ _rows(h)  # [out, in/tp]
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


# ---- public entry points ---------------------------------------------------------------------------

def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Optional[Sequence[Optional[torch.Tensor]]] = None, group=None,
                      save_gathered_input: bool = True) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i) for each i], the gather pipelined with the GEMMs.

    x_local: [s/tp, b, in] (sequence-first, this rank's tokens); W_i: [out_i/tp, in]; returns
    [s, b, out_i/tp] per weight. Several weights share one gathered input (q/k/v, up/gate).
    save_gathered_input=False keeps only x_local for backward (1/tp of the memory) and re-gathers
    it there, hidden behind the input-gradient GEMMs. Process group: `group` (None: tp=1).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases")
    if comm._size(group) == 1:
        return [torch.nn.functional.linear(x_local, w, b) for w, b in zip(weights, biases)]
    return list(_AllGatherLinear.apply(x_local, group, save_gathered_input, *weights, *biases))


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """reduce_scatter_along_seq(F.linear(h, weight)), the GEMM pipelined with the reduce-scatter.

    h: [s, b, in/tp] (sequence-first); weight: [out, in/tp]; returns this rank's summed tokens
    [s/tp, b, out]. Raises ValueError when s is not divisible by tp. Process group: `group`.
    """
    world = comm._size(group)
    if world == 1:
        return torch.nn.functional.linear(h, weight)
    if h.shape[0] % world:
        raise ValueError(f"sequence length {h.shape[0]} (dim 0 of {tuple(h.shape)}) is not divisible by tp={world}")
    return _LinearReduceScatter.apply(h, weight, group)
