"""How the overlapped sequence-parallel GEMMs run: the autograd Functions behind
tpflash.parallel.overlap's entry points, and the GEMMs and transfers they are made of.

  column forward   ys = all_gather(x) @ [W_1; ..; W_n]^T   this rank's rows are multiplied while the
                   copy engines move the others; each peer's rows are multiplied once they are here
                   (x kept for the backward by default: inside a graph capture in a buffer of
                   the layer's own, which the peers' rows are pushed into, nothing copied out)
  column backward  grad_x = reduce_scatter(grad_y @ W)     the rows due to each peer are computed and
                   sent first; the weight-gradient GEMM runs while they travel (one GEMM over x
                   gathered again beside the first GEMMs, unless x was kept; over a kept x, the
                   MLP's up projection may hold it for the output projection's backward instead:
                   tpflash.parallel.held_work, and this rank's rows are multiplied beside the
                   transfers); this rank's rows last, their GEMM adding the parts received
                   (two ranks: in its epilogue)
  row forward      y = reduce_scatter(h @ W^T) + b         the same sends (the first peer's rows in two
                   GEMMs where the GEMM is shorter than its transfer, so that the transfer starts
                   early; the own rows' GEMM, which adds the bias, and any work held for this
                   layer, tpflash.parallel.held_work, cover the last transfers); y summed, or
                   left as its parts for the next norm to add (`parts`: inside a graph capture)
  row backward     grad_h = all_gather(grad_y) @ W,         as the column forward (GEMMs held back from an
                   grad_W = all_gather(grad_y)^T h           earlier layer run after this rank's rows, while
                                                            the peers' travel), then the weight gradient in
                                                            one GEMM over the gathered grad_y, or that GEMM
                                                            held for a later layer (`grad_held_for`: the
                                                            MLP's down projection, batched with the up's)

Activations are sequence-first ([s/tp, b, feat] per rank), so "rank r's rows" are one contiguous
block of [s*b, feat] and every piece is a plain GEMM into a slice of the output. The transfers come
from tpflash.parallel.overlap_transfers: the copy engines where they reach the group, else the
group's own collectives with nothing overlapped (what the CPU tests run). Process group: the tp
group passed in.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..kernels import column_sum, concat_with_column_sum
from ..kernels.column_sum import concat_rows
from ..kernels.weight_grad import weight_grad_fp32
from ..layers.main_grads import main_grad_of, split_or_none
from ..layers.weight_casts import stacked_cast
from . import overlap_transfers as transfers
from .held_work import HeldWork
from .overlap_transfers import linear_compute_dtype


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[*, feat] -> [rows, feat] (a view when t is contiguous)."""
    return t.reshape(-1, t.shape[-1])


def _no_autocast(x: torch.Tensor):
    return torch.autocast(x.device.type, enabled=False)


def _peers_first(rank: int, world: int) -> List[int]:
    """Ranks in sending order: the peers after this rank, this rank last (its part is not sent)."""
    return [(rank + step) % world for step in range(1, world)]


def _gather_multiply(gather, w: torch.Tensor, b: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """out[rows of rank r] = gather.piece(r) @ w (+ b), each rank's rows as soon as they are here."""
    m = out.shape[0] // len(gather.order())
    for r in gather.order():
        dst = out[r * m:(r + 1) * m]
        if b is None:
            torch.mm(gather.piece(r), w, out=dst)
        else:
            torch.addmm(b, gather.piece(r), w, out=dst)


def _gather_multiply_both(gather, w: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor,
                          held: Optional[HeldWork] = None,
                          main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A row layer's two backward GEMMs over an all-gathered grad_y: grad_h = grad_y @ w, then the fp32
    weight gradient grad_y^T h (added into `main_grad` where given, which is then what is returned).
    Where GEMMs are `held` back from an earlier layer, they run first, while the peers' rows travel,
    and grad_h is one GEMM over every rank's rows (`gather.whole()`); else grad_h is computed rank by
    rank as the pieces arrive, this rank's rows first (a GEMM per rank's rows runs slower than one
    over them all: docs/overlap.md, "Costs and limits")."""
    if held is not None and held.pending:
        held.run()
        whole = gather.whole()
        if whole is not None:
            torch.mm(whole, w, out=grad_h)
            return _weight_grad_with_gathered(gather, h, gathered_is_grad=True, main_grad=main_grad)
    m = grad_h.shape[0] // len(gather.order())
    for r in gather.order():
        torch.mm(gather.piece(r), w, out=grad_h[r * m:(r + 1) * m])
    return _weight_grad_with_gathered(gather, h, gathered_is_grad=True, main_grad=main_grad)


def _holds(held: Optional[HeldWork], weight_dtypes: Sequence[torch.dtype]) -> bool:
    """Whether a weight gradient is held back for `held`: where it holds gradients now and every weight
    the gradient feeds is fp32 (`_weight_grad_now_or_held`)."""
    return held is not None and held.holds_gradients and all(dt == torch.float32 for dt in weight_dtypes)


def _weight_grad_now_or_held(held: Optional[HeldWork], grad_y: torch.Tensor, x: torch.Tensor,
                             weight_dtypes: Sequence[torch.dtype],
                             main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 weight gradient grad_y^T x (grad_y [rows, out], x [rows, in]): computed now, or, where
    `held` allows it, an unfilled [out, in] tensor that the held GEMM writes before anything reads it
    (tpflash.parallel.held_work). Held only where every weight it feeds is fp32: the
    gradient then reaches them without a cast that would read it early. With `main_grad` the GEMM adds
    into it (now or held), and main_grad is returned."""
    if not _holds(held, weight_dtypes):
        return weight_grad_fp32(grad_y, x, into=main_grad)
    if main_grad is not None:
        held.hold_weight_grad(grad_y, x, into=main_grad)
        return main_grad
    grad_w = torch.empty((grad_y.shape[1], x.shape[1]), dtype=torch.float32, device=grad_y.device)
    held.hold_weight_grad(grad_y, x, out=grad_w)
    return grad_w


def _weight_grad_with_gathered(gather, other: torch.Tensor, gathered_is_grad: bool,
                               main_grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 weight gradient grad^T x where one of grad, x is the all-gathered tensor and `other`
    [world*m, *] the other: one GEMM over every rank's rows where the gather gives them as one tensor
    (a GEMM as long as tp=1's), else summed rank by rank over the pieces; added into `main_grad` where
    given (and that returned)."""
    whole = gather.whole()
    if whole is not None:
        grad, x = (whole, other) if gathered_is_grad else (other, whole)
        return weight_grad_fp32(grad, x, into=main_grad)
    m = other.shape[0] // len(gather.order())
    grad_w = main_grad
    for r in gather.order():
        mine, piece = other[r * m:(r + 1) * m], gather.piece(r)
        grad, x = (piece, mine) if gathered_is_grad else (mine, piece)
        grad_w = weight_grad_fp32(grad, x, into=grad_w)
    return grad_w


def _multiply_scatter(a: torch.Tensor, w: torch.Tensor, group, bias: Optional[torch.Tensor] = None,
                      held: Optional[HeldWork] = None, parts: bool = False) -> List[torch.Tensor]:
    """reduce_scatter(a @ w) + bias: a [world*m, k], w [k, n], bias [n] -> this rank's rows [m, n], as
    one summed tensor, or with `parts` as the parts of that sum where the transfers can leave them
    unsummed (PeerReduceScatter.finish_parts); the rows due to each peer are sent while the next rows
    are multiplied, and the work `held` for this layer runs while the last of them travel. See
    `_send_parts` for the split form."""
    pending, own = _send_parts(a, w, group, bias)
    if held is not None:
        held.run()
    return pending.finish_parts(own) if parts else [pending.finish(own)]


SEND_CHUNKS = 2  # GEMMs for the first peer's rows where the GEMM is shorter than its transfer
# Below this inner dimension a peer's rows take longer to travel than to multiply (a part moves at
# ~340 GB/s on the copy engines, its GEMM runs at ~600 TFLOP/s bf16: even at k ~ 1800), so the first
# transfer is started after half of its GEMM; above it, the GEMMs that follow hide every transfer and
# a split GEMM only costs a launch and some efficiency (docs/overlap.md).
CHUNK_BELOW_INNER = 2048


def _send_parts(a: torch.Tensor, w: torch.Tensor, group, bias: Optional[torch.Tensor] = None):
    """(pending reduce-scatter, this rank's own part): every peer's rows of a @ w computed and sent
    (`_send_peer_parts`), then the own rows' GEMM, which adds the bias (once per token: only the
    rank that keeps a token's sum adds it)."""
    pending, own = _send_peer_parts(a, w, group)
    return pending, own @ w if bias is None else torch.addmm(bias, own, w)


def _send_peer_parts(a: torch.Tensor, w: torch.Tensor, group):
    """(pending reduce-scatter of a @ w, this rank's rows of a): every peer's rows multiplied and sent,
    one GEMM each (fewer, larger GEMMs; the transfers queue behind each other on the side stream
    anyway, the copy engines' bandwidth being shared by all peers), the first peer's in SEND_CHUNKS
    GEMMs where the inner dimension is under CHUNK_BELOW_INNER (e.g. the attention's output
    projection): there the GEMM is short next to its transfer, which then starts early."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    m = a.shape[0] // world
    pending = transfers.reduce_scatter(group, (m, w.shape[1]), a)
    first_chunks = SEND_CHUNKS if a.shape[1] < CHUNK_BELOW_INNER else 1
    for i, r in enumerate(_peers_first(rank, world)):
        for rows in _chunks(m, first_chunks if i == 0 else 1):
            pending.send(r, a[r * m + rows.start:r * m + rows.stop] @ w, rows.start)
    return pending, a[rank * m:(rank + 1) * m]


# The column backward's input gradient is one GEMM, its peers' rows pushed after it, where the weight
# gradient's GEMM that follows outlasts those pushes: [rows, out] x [rows, in] at ~600 TFLOP/s against
# (world-1)/world of [rows, in] at ~340 GB/s, i.e. where out * world / (world - 1) is above ~1,800.
# A GEMM per rank's rows ran up to 17 us slower than one over them all at gpt-2.7b's and llama-1b's
# tp=2 and tp=4 shapes (docs/overlap.md, "Costs and limits").
ONE_GEMM_FROM_WIDTH = 2048


def _one_input_grad_gemm(out_width: int, world: int) -> bool:
    """Whether a column layer of `out_width` output features per rank computes its input gradient in one
    GEMM, its weight gradient's GEMM covering the pushes (ONE_GEMM_FROM_WIDTH)."""
    return out_width * world >= ONE_GEMM_FROM_WIDTH * (world - 1)


def _send_all_parts(a: torch.Tensor, w: torch.Tensor, group):
    """(pending reduce-scatter of a @ w, this rank's rows of it): a @ w in one GEMM, then every peer's
    rows pushed, to travel beside what the caller issues next."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    m = a.shape[0] // world
    product = a @ w  # [world*m, n]
    pending = transfers.reduce_scatter(group, (m, w.shape[1]), a)
    for r in _peers_first(rank, world):
        pending.send(r, product[r * m:(r + 1) * m])
    return pending, product[rank * m:(rank + 1) * m]


def _chunks(m: int, n: int) -> List[slice]:
    """range(m) in n contiguous slices, as even as whole rows allow (none empty)."""
    bounds = [m * i // n for i in range(n + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


class _ColumnLinearOverPeers(torch.autograd.Function):
    """ys_i = all_gather_seq(x_local) @ W_i^T + b_i: x_local [s/tp, b, in] -> ys_i [s, b, out_i/tp].
    save_gathered: keep the gathered input for the weight gradient, else gather it again there.
    held: where the weight gradient over a kept input may be held back (HeldWork), or None.
    casts: a block's weight casts (tpflash.layers.weight_casts.PendingCast), or None.
    tensors: n_ports gradient ports (overlap.all_gather_linear's grad_ports), then the weights, then
    the biases."""

    @staticmethod
    def forward(ctx, x_local, group, save_gathered, held, casts, n, n_ports, *tensors):
        params = tensors[n_ports:]
        weights, biases = params[:n], params[n:]
        ctx.n_ports = n_ports
        dtype = linear_compute_dtype(x_local)
        ctx.group, ctx.x_dtype, ctx.local_shape, ctx.held = group, x_local.dtype, x_local.shape, held
        ctx.sizes, ctx.save_gathered = [w.shape[0] for w in weights], save_gathered
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.main_grad = main_grad_of(weights)  # where the weight gradient is added (tpflash.layers.main_grads)
        rows = _rows(x_local.to(dtype))  # [s/tp*b, in]
        world = dist.get_world_size(group)
        with _no_autocast(rows):
            w_c = stacked_cast(weights, dtype, casts)  # [sum out_i/tp, in]
            b_c = None if biases[0] is None else stacked_cast(biases, dtype, casts)
            gather = transfers.all_gather(rows, group, keep=save_gathered, owner=weights[0])
            out = rows.new_empty((world * rows.shape[0], w_c.shape[0]))  # [s*b, sum out_i/tp]
            _gather_multiply(gather, w_c.t(), b_c, out)
            x_full = gather.finish()  # [s*b, in] (None when not kept)
        ctx.save_for_backward(x_full if save_gathered else rows, w_c)
        lead = (world * x_local.shape[0],) + tuple(x_local.shape[1:-1])
        return tuple(out.view(lead + (w_c.shape[0],)).split(ctx.sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grad_ys):
        x_saved, w_c = ctx.saved_tensors  # x_saved: [s*b, in], or [s/tp*b, in] to gather again
        n, world = len(ctx.sizes), dist.get_world_size(ctx.group)
        rows = x_saved.shape[0] * (1 if ctx.save_gathered else world)
        lead = next((g.shape[:-1] for g in grad_ys if g is not None), (rows,))  # [s, b] (or [s*b])
        grads = [torch.zeros(lead + (size,), dtype=w_c.dtype, device=w_c.device) if g is None
                 else g.to(w_c.dtype) for g, size in zip(grad_ys, ctx.sizes)]  # [s, b, out_i] (views)
        first_param = 7 + ctx.n_ports  # the index of the first weight among forward's inputs
        has_bias = ctx.param_dtypes[n] is not None and any(ctx.needs_input_grad[first_param + n:])
        bias_sums = None
        if n > 1 and has_bias:  # concatenated and their column sums taken in one pass
            grad_y, bias_sums = concat_with_column_sum(grads)  # [s*b, sum out]
        else:
            grad_y = _rows(grads[0]).contiguous() if n == 1 else concat_rows(grads)  # no copy if already one buffer
        with _no_autocast(x_saved):
            gather = None if ctx.save_gathered else transfers.all_gather(x_saved, ctx.group, keep=False, whole=True)
            holding = gather is None and _holds(ctx.held, ctx.param_dtypes[:n])
            own = None  # this rank's part of grad_x, where computed before the weight gradient
            if ctx.n_ports and gather is None and not holding and _one_input_grad_gemm(w_c.shape[0], world):
                pending, own = _send_all_parts(grad_y, w_c, ctx.group)  # the parts travel while ...
            else:
                pending, own_rows = _send_peer_parts(grad_y, w_c, ctx.group)  # grad_x's parts travel while ...
                own = own_rows @ w_c if holding else None  # ... this rank's rows are multiplied, where nothing else is
            if gather is None:  # ... the weight gradient is computed (or held for a later layer's waits)
                grad_w = _weight_grad_now_or_held(ctx.held, grad_y, x_saved, ctx.param_dtypes[:n], ctx.main_grad)
            else:
                grad_w = _weight_grad_with_gathered(gather, grad_y, gathered_is_grad=False, main_grad=ctx.main_grad)
            grad_w = split_or_none(ctx.main_grad, grad_w, ctx.sizes)
            if has_bias:
                grad_b = (column_sum(grad_y) if bias_sums is None else bias_sums).split(ctx.sizes)
            else:
                grad_b = [None] * n
            # [s/tp*b, in]: with the weight gradient computed, the parts are here by now
            if ctx.n_ports:  # this rank's part for x_local, the received ones (if unsummed) for the ports
                parts = pending.finish_parts(own if own is not None else own_rows @ w_c)
            else:
                parts = [pending.finish(own) if own is not None else pending.finish_matmul(own_rows, w_c)]
            if gather is not None:
                gather.finish()
        grad_x, *received = (part.view(ctx.local_shape).to(ctx.x_dtype) for part in parts)
        if len(received) > ctx.n_ports:
            raise RuntimeError(f"{len(received)} received parts of the input gradient for {ctx.n_ports} ports")
        port_grads = received + [None] * (ctx.n_ports - len(received))  # a port without one adds nothing
        params = [None if g is None else g.to(dt) for g, dt in zip(list(grad_w) + list(grad_b), ctx.param_dtypes)]
        return (grad_x, None, None, None, None, None, None, *port_grads, *params)


class _RowLinearOverPeers(torch.autograd.Function):
    """y_local = reduce_scatter_seq(h @ W^T) + b: h [s, b, in/tp] -> y_local [s/tp, b, out], returned
    as a tuple of one tensor, or with `parts` of several whose sum y_local is (this rank's own part
    first, the only differentiable one: y_local's gradient is its gradient); the bias's gradient is
    this rank's tokens' part. casts: a block's weight casts (PendingCast), or None. grad_held_for:
    where the weight-gradient GEMM may be held (HeldWork, while it holds gradients), over the gathered
    grad_y kept for it (inside a graph capture in the group's buffer for those,
    overlap_transfers.held_grad_y_owner), or None."""

    @staticmethod
    def forward(ctx, h, weight, bias, group, held, parts, casts, grad_held_for):
        dtype = linear_compute_dtype(h)
        ctx.group, ctx.dtypes, ctx.held = group, (h.dtype, weight.dtype, None if bias is None else bias.dtype), held
        ctx.grad_held_for = grad_held_for
        ctx.main_grad = main_grad_of([weight])  # where the weight gradient is added (tpflash.layers.main_grads)
        h, w = h.to(dtype).contiguous(), stacked_cast([weight], dtype, casts)
        with _no_autocast(h):
            b_c = None if bias is None else stacked_cast([bias], dtype, casts)
            ys = _multiply_scatter(_rows(h), w.t(), group, b_c, held, parts)  # [s/tp*b, out] each
        ctx.save_for_backward(h, w)
        shape = (h.shape[0] // dist.get_world_size(group),) + tuple(h.shape[1:-1]) + (w.shape[0],)
        ys = tuple(y.view(shape) for y in ys)
        ctx.mark_non_differentiable(*ys[1:])  # other ranks' parts: their gradients are theirs to compute
        # and autograd is not to fill zeros for them: a [s/tp, b, out] memset per part and step
        ctx.set_materialize_grads(False)
        return ys

    @staticmethod
    def backward(ctx, grad_y, *_received):
        if grad_y is None:  # nothing reached this rank's own part
            return None, None, None, None, None, None, None, None
        h, w = ctx.saved_tensors
        holding = _holds(ctx.grad_held_for, ctx.dtypes[1:2])
        with _no_autocast(h):
            grad_rows = _rows(grad_y.to(h.dtype))  # [s/tp*b, out]
            gather = transfers.all_gather(grad_rows, ctx.group, keep=holding, whole=True,
                                          owner=transfers.held_grad_y_owner(ctx.group) if holding else None)
            grad_h = h.new_empty(_rows(h).shape)  # [s*b, in/tp]
            if holding:  # grad_h rank by rank as the pieces arrive; the weight gradient over the kept grad_y, later
                _gather_multiply(gather, w, None, grad_h)
                grad_w = _weight_grad_now_or_held(ctx.grad_held_for, gather.finish(), _rows(h), ctx.dtypes[1:2],
                                                  ctx.main_grad)
            else:
                grad_w = _gather_multiply_both(gather, w, _rows(h), grad_h, ctx.held, ctx.main_grad)  # [out, in/tp]
            grad_b = column_sum(grad_rows).to(ctx.dtypes[2]) if ctx.needs_input_grad[2] else None
            if not holding:
                gather.finish()
        grad_w = None if ctx.main_grad is not None else grad_w.to(ctx.dtypes[1])  # main_grad: added there
        return grad_h.view(h.shape).to(ctx.dtypes[0]), grad_w, grad_b, None, None, None, None, None
