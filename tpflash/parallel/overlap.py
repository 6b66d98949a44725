"""Sequence-parallel GEMMs overlapped with copy-engine transfers, and when they run.

Under sequence parallelism a column-parallel GEMM needs the all-gathered input and a row-parallel
GEMM ends in a reduce-scatter; done one after the other, the GPU waits for each collective.
`all_gather_linear` and `linear_reduce_scatter` compute what the serial layers compute, one GEMM
per rank's rows while the GPUs' copy engines move the other ranks' rows
(tpflash.parallel.peer_collectives). Copy engines leave the SMs to the GEMMs: on 2 H200s a GEMM
beside a copy-engine transfer of its activation ran 4% slower, beside an SM-kernel copy (what
NCCL's kernels are) 30% slower (docs/overlap.md). So one piece per rank is enough, and each piece
is one GEMM over the weights stacked (q/k/v, up/gate) as in tpflash.layers.autocast_linear:

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
                   early; the own rows' GEMM, which adds the
                   bias, and any work held for this layer, tpflash.parallel.held_work, cover the
                   last transfers)
  row backward     grad_h = all_gather(grad_y) @ W,         as the column forward (GEMMs held back from an
                   grad_W = all_gather(grad_y)^T h           earlier layer run after this rank's rows, while
                                                            the peers' travel), then the weight gradient in
                                                            one GEMM over the gathered grad_y

Activations are sequence-first ([s/tp, b, feat] per rank), so "rank r's rows" are one contiguous
block of [s*b, feat] and every piece is a plain GEMM into a slice of the output. Where the GPUs
cannot map each other's memory (CPU, gloo, GPUs of several hosts, TPFLASH_COMM_BACKEND=nccl) the
same Functions run over the group's own collectives with nothing overlapped: that is what the CPU
tests run; the copy engines are tested on 2 GPUs.

When the overlapped path runs, decided where the layers are built or captured, never per call:
  * a layer's own `overlap=True/False` (`set_overlap(model, enabled)` sets it for a whole model);
  * for layers with overlap=None (the default): TPFLASH_OVERLAP=1 / 0, read once at import;
  * with neither, the default: on for the work a CUDA graph captures (GraphedBlocks decides once
    per capture, `capture_decision`, and hands the decision to the blocks' layers for the capture:
    `overlapping_for_capture`) where the copy engines reach the tp group, the setup where it was
    measured faster than serial collectives; off everywhere else.
Results are the same either way up to the order of floating-point sums. Process group: the tp
group passed in.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..kernels import column_sum, concat_with_column_sum
from ..kernels.column_sum import concat_rows
from ..kernels.weight_grad import weight_grad_fp32
from ..layers.main_grads import main_grad_of, split_or_none
from ..layers.weight_casts import stacked_cast
from . import comm, peer_collectives
from .held_work import HeldWork
from .state import group_size

_ENV = "TPFLASH_OVERLAP"
_BACKEND_ENV = "TPFLASH_OVERLAP_BACKEND"  # only "copy_engine" (or "auto") is accepted: one design


def _env_setting() -> Optional[bool]:
    """TPFLASH_OVERLAP: "1"/"true"/"on"/"yes" on, any other value off, unset None. Raises ValueError
    for a TPFLASH_OVERLAP_BACKEND other than the copy engines."""
    backend = os.environ.get(_BACKEND_ENV, "").strip().lower()
    if backend not in ("", "auto", "copy_engine"):
        raise ValueError(f"{_BACKEND_ENV}={backend!r} is not supported: tpflash overlaps communication through "
                         f"the copy engines only (docs/overlap.md, \"Designs not kept\"). Unset {_BACKEND_ENV}; "
                         f"{_ENV}=1 or 0 turns overlap on or off")
    env = os.environ.get(_ENV, "").strip().lower()
    return (env in ("1", "true", "on", "yes")) if env else None


ENVIRONMENT_SETTING: Optional[bool] = _env_setting()  # TPFLASH_OVERLAP at import: None when unset


def layer_overlaps(overlap: Optional[bool]) -> bool:
    """Whether a layer whose overlap flag is `overlap` takes the overlapped path: its flag, else the
    environment's (TPFLASH_OVERLAP), else off."""
    return bool(ENVIRONMENT_SETTING if overlap is None else overlap)


def _overlap_flags(module: nn.Module) -> List[nn.Module]:
    """module and its submodules that carry an overlap flag (Column/RowParallelLinear, GPT's head)."""
    return [m for m in module.modules() if "overlap" in vars(m) and (m.overlap is None or isinstance(m.overlap, bool))]


def set_overlap(module: nn.Module, enabled: Optional[bool]) -> None:
    """Set the overlap flag of every layer of `module` that has one: True / False win over TPFLASH_OVERLAP
    and over a capture's default; None returns them to those defaults. A CUDA graph captured after it
    keeps the choice."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_overlap(enabled={enabled!r}): enabled must be True, False or None")
    for m in _overlap_flags(module):
        m.overlap = enabled


def copy_engines_reach(x: torch.Tensor, group) -> bool:
    """Whether x's collectives over group can go through the copy engines: CUDA, every rank on its own
    GPU of one host with peer access (peer_collectives.reachable), TPFLASH_COMM_BACKEND not "nccl"."""
    return peer_collectives.comm_backend() != "nccl" and peer_collectives.reachable(x, group)


def capture_decision(x: torch.Tensor, group) -> bool:
    """Whether work captured for input x over the tp group overlaps where its layers leave it to the
    default: TPFLASH_OVERLAP if set, else where the copy engines reach the group. Asks the group
    once (peer_collectives.peer_access): every rank must call it together, outside capture."""
    if ENVIRONMENT_SETTING is not None:
        return ENVIRONMENT_SETTING
    return group_size(group) > 1 and copy_engines_reach(x, group)


@contextlib.contextmanager
def overlapping_for_capture(blocks: Sequence[nn.Module], decision: bool):
    """The warm-up and capture of a CUDA graph of `blocks` (GraphedBlocks): their layers left to the
    default (overlap=None) take `decision` (capture_decision) for the capture, and get None back
    after it; the replays keep what was captured. Serial collectives go through the copy engines
    where the comm backend says so for captured work (peer_collectives.for_graph_capture). Yields
    whether any of the blocks' layers overlaps in the capture."""
    flagged = [m for b in blocks for m in _overlap_flags(b)]
    defaulted = [m for m in flagged if m.overlap is None]
    for m in defaulted:
        m.overlap = bool(decision)
    try:
        with peer_collectives.for_graph_capture():
            yield any(m.overlap for m in flagged)
    finally:
        for m in defaulted:
            m.overlap = None


# ---- dtype handling under autocast -----------------------------------------------------------------

def linear_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in for input x here: the autocast dtype when autocast is on
    (autocast leaves float64 alone), else x's."""
    dev = x.device.type
    if (dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and x.is_floating_point()
            and x.dtype != torch.float64):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[*, feat] -> [rows, feat] (a view when t is contiguous)."""
    return t.reshape(-1, t.shape[-1])


def _no_autocast(x: torch.Tensor):
    return torch.autocast(x.device.type, enabled=False)


# ---- the collectives, by rank ----------------------------------------------------------------------

_side_streams = {}  # device -> the stream the copy engines' transfers are queued on


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class _GroupAllGather:
    """PeerAllGather's interface over the group's own all-gather (no overlap)."""

    def __init__(self, x: torch.Tensor, group):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.x, self.out = x, comm.all_gather(x, 0, group)

    def order(self) -> List[int]:
        return [(self.rank + step) % self.world for step in range(self.world)]

    def piece(self, r: int) -> torch.Tensor:
        return self.out.chunk(self.world)[r]

    def whole(self) -> torch.Tensor:
        return self.out

    def finish(self) -> torch.Tensor:
        return self.out


class _GroupReduceScatter:
    """PeerReduceScatter's interface over the group's own reduce-scatter (no overlap)."""

    def __init__(self, group, shape, dtype: torch.dtype, device: torch.device):
        self.group, self.rank = group, dist.get_rank(group)
        self.parts = torch.empty((dist.get_world_size(group),) + tuple(shape), dtype=dtype, device=device)

    def send(self, r: int, part: torch.Tensor, row: int = 0) -> None:
        self.parts[r][row:row + part.shape[0]].copy_(part)

    def finish(self, own: torch.Tensor) -> torch.Tensor:
        self.parts[self.rank].copy_(own)
        return comm.reduce_scatter(self.parts, 0, self.group)[0]

    def finish_matmul(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.finish(a @ w)


def _all_gather(x: torch.Tensor, group, keep: bool = True, whole: bool = False,
                owner: Optional[torch.Tensor] = None):
    """The all-gather of x over group, each rank's part usable as it arrives; keep=False: `finish`
    need not return the gathered tensor (the copy engines then copy nothing out); whole: `whole()`
    may give every part as one tensor (or None: then by `piece`). keep with `owner` (the layer's first
    weight), in the work a CUDA graph captures: the parts arrive in a buffer of the owner's own
    (peer_collectives.kept_buffer), which `finish` returns as it is: nothing copied out, the capture
    guaranteeing the one backward per forward that keeps it valid."""
    if copy_engines_reach(x, group):
        kept = None
        if keep and owner is not None and peer_collectives.capturing_for_graphs():
            nbytes = dist.get_world_size(group) * x.numel() * x.element_size()
            kept = peer_collectives.kept_buffer(owner, group, x.device, nbytes)
        return peer_collectives.PeerAllGather(x, group, _side_stream(x.device), keep=keep, by_piece=True,
                                              whole=whole, kept=kept)
    return _GroupAllGather(x, group)


def _reduce_scatter(group, shape, like: torch.Tensor):
    if copy_engines_reach(like, group):
        return peer_collectives.PeerReduceScatter(group, shape, like.dtype, like.device, _side_stream(like.device))
    return _GroupReduceScatter(group, shape, like.dtype, like.device)


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
    """A row layer's two backward GEMMs over an all-gathered grad_y: grad_h[rows of r] = piece(r) @ w,
    rank by rank as the pieces arrive, then the fp32 weight gradient grad_y^T h (added into `main_grad`
    where given, which is then what is returned). The GEMMs `held` back from an earlier layer run
    after this rank's rows, while the peers' rows travel."""
    m = grad_h.shape[0] // len(gather.order())
    for i, r in enumerate(gather.order()):
        torch.mm(gather.piece(r), w, out=grad_h[r * m:(r + 1) * m])
        if i == 0 and held is not None:
            held.run()
    return _weight_grad_with_gathered(gather, h, gathered_is_grad=True, main_grad=main_grad)


def _holds(held: Optional[HeldWork], weight_dtypes: Sequence[torch.dtype]) -> bool:
    """Whether a weight gradient is held back for `held` (`_weight_grad_now_or_held`)."""
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
        held.hold(lambda: weight_grad_fp32(grad_y, x, into=main_grad))
        return main_grad
    grad_w = torch.empty((grad_y.shape[1], x.shape[1]), dtype=torch.float32, device=grad_y.device)
    held.hold(lambda: weight_grad_fp32(grad_y, x, out=grad_w))
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
                      held: Optional[HeldWork] = None) -> torch.Tensor:
    """reduce_scatter(a @ w) + bias: a [world*m, k], w [k, n], bias [n] -> this rank's summed rows [m, n];
    the rows due to each peer are sent while the next rows are multiplied, and the work `held` for
    this layer runs while the last of them travel. See `_send_parts` for the split form."""
    pending, own = _send_parts(a, w, group, bias)
    if held is not None:
        held.run()
    return pending.finish(own)


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
    pending = _reduce_scatter(group, (m, w.shape[1]), a)
    first_chunks = SEND_CHUNKS if a.shape[1] < CHUNK_BELOW_INNER else 1
    for i, r in enumerate(_peers_first(rank, world)):
        for rows in _chunks(m, first_chunks if i == 0 else 1):
            pending.send(r, a[r * m + rows.start:r * m + rows.stop] @ w, rows.start)
    return pending, a[rank * m:(rank + 1) * m]


def _chunks(m: int, n: int) -> List[slice]:
    """range(m) in n contiguous slices, as even as whole rows allow (none empty)."""
    bounds = [m * i // n for i in range(n + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


class _ColumnLinearOverPeers(torch.autograd.Function):
    """ys_i = all_gather_seq(x_local) @ W_i^T + b_i: x_local [s/tp, b, in] -> ys_i [s, b, out_i/tp].
    save_gathered: keep the gathered input for the weight gradient, else gather it again there.
    held: where the weight gradient over a kept input may be held back (HeldWork), or None."""

    @staticmethod
    def forward(ctx, x_local, group, save_gathered, held, n, *params):
        weights, biases = params[:n], params[n:]
        dtype = linear_compute_dtype(x_local)
        ctx.group, ctx.x_dtype, ctx.local_shape, ctx.held = group, x_local.dtype, x_local.shape, held
        ctx.sizes, ctx.save_gathered = [w.shape[0] for w in weights], save_gathered
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.main_grad = main_grad_of(weights)  # where the weight gradient is added (tpflash.layers.main_grads)
        rows = _rows(x_local.to(dtype))  # [s/tp*b, in]
        world = dist.get_world_size(group)
        with _no_autocast(rows):
            w_c = stacked_cast(weights, dtype)  # [sum out_i/tp, in]
            b_c = None if biases[0] is None else stacked_cast(biases, dtype)
            gather = _all_gather(rows, group, keep=save_gathered, owner=weights[0])
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
        has_bias = ctx.param_dtypes[n] is not None and any(ctx.needs_input_grad[5 + n:])
        bias_sums = None
        if n > 1 and has_bias:  # concatenated and their column sums taken in one pass
            grad_y, bias_sums = concat_with_column_sum(grads)  # [s*b, sum out]
        else:
            grad_y = _rows(grads[0]).contiguous() if n == 1 else concat_rows(grads)  # no copy if already one buffer
        with _no_autocast(x_saved):
            gather = None if ctx.save_gathered else _all_gather(x_saved, ctx.group, keep=False, whole=True)
            pending, own_rows = _send_peer_parts(grad_y, w_c, ctx.group)  # grad_x's parts travel while ...
            holding = gather is None and _holds(ctx.held, ctx.param_dtypes[:n])
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
            grad_x = pending.finish(own) if holding else pending.finish_matmul(own_rows, w_c)
            if gather is not None:
                gather.finish()
        params = [None if g is None else g.to(dt) for g, dt in zip(list(grad_w) + list(grad_b), ctx.param_dtypes)]
        return (grad_x.view(ctx.local_shape).to(ctx.x_dtype), None, None, None, None, *params)


class _RowLinearOverPeers(torch.autograd.Function):
    """y_local = reduce_scatter_seq(h @ W^T) + b: h [s, b, in/tp] -> y_local [s/tp, b, out]; the bias's
    gradient is this rank's tokens' part."""

    @staticmethod
    def forward(ctx, h, weight, bias, group, held):
        dtype = linear_compute_dtype(h)
        ctx.group, ctx.dtypes, ctx.held = group, (h.dtype, weight.dtype, None if bias is None else bias.dtype), held
        ctx.main_grad = main_grad_of([weight])  # where the weight gradient is added (tpflash.layers.main_grads)
        h, w = h.to(dtype).contiguous(), stacked_cast([weight], dtype)
        with _no_autocast(h):
            b_c = None if bias is None else stacked_cast([bias], dtype)
            y = _multiply_scatter(_rows(h), w.t(), group, b_c, held)  # [s/tp*b, out]
        ctx.save_for_backward(h, w)
        return y.view((h.shape[0] // dist.get_world_size(group),) + tuple(h.shape[1:-1]) + (w.shape[0],))

    @staticmethod
    def backward(ctx, grad_y):
        h, w = ctx.saved_tensors
        with _no_autocast(h):
            grad_rows = _rows(grad_y.to(h.dtype))  # [s/tp*b, out]
            gather = _all_gather(grad_rows, ctx.group, keep=False, whole=True)
            grad_h = h.new_empty(_rows(h).shape)  # [s*b, in/tp]
            grad_w = _gather_multiply_both(gather, w, _rows(h), grad_h, ctx.held, ctx.main_grad)  # [out, in/tp]
            grad_b = column_sum(grad_rows).to(ctx.dtypes[2]) if ctx.needs_input_grad[2] else None
            gather.finish()
        grad_w = None if ctx.main_grad is not None else grad_w.to(ctx.dtypes[1])  # main_grad: added there
        return grad_h.view(h.shape).to(ctx.dtypes[0]), grad_w, grad_b, None, None


# ---- entry points ----------------------------------------------------------------------------------

def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Optional[Sequence[Optional[torch.Tensor]]] = None, group=None,
                      save_gathered_input: Optional[bool] = None,
                      held: Optional[HeldWork] = None) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i) for each i], the gather overlapped with the GEMMs.

    x_local: [s/tp, b, in] (sequence-first, this rank's tokens); W_i: [out_i/tp, in]; returns
    [s, b, out_i/tp] per weight. Several weights share one gathered input (q/k/v, up/gate).
    save_gathered_input=True keeps the gathered input for the backward (tp times the memory of
    x_local; inside a CUDA graph's capture in a buffer of the layer's own, peer_collectives.kept_buffer,
    elsewhere copied out of the peer buffers); False keeps only x_local and gathers it again in the
    backward, beside the input-gradient GEMMs; None (default): `keeps_gathered_input`. held: over a
    kept input, the weight gradient's GEMM may be held back for a later layer's waits
    (tpflash.parallel.held_work). Process group: `group` (None: tp=1).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases")
    if group_size(group) == 1:
        return [torch.nn.functional.linear(x_local, w, b) for w, b in zip(weights, biases)]
    if any(b is not None for b in biases):  # one stacked bias: zeros (no gradient) where a weight has none
        biases = [torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
                  for w, b in zip(weights, biases)]
    keep = keeps_gathered_input(save_gathered_input)
    return list(_ColumnLinearOverPeers.apply(x_local, group, keep, held, len(weights), *weights, *biases))


def keeps_gathered_input(save_gathered_input: Optional[bool]) -> bool:
    """Whether an overlapped column GEMM keeps its all-gathered input for the backward: the layer's
    save_gathered_input where set, else yes. Gathering it again keeps only the local shard (1/tp of
    the memory) but moves (tp-1)/tp of the activation through the copy engines once more in each
    backward and copies this rank's rows beside the others'; a kept input also lets the MLP's up
    projection hold its weight gradient for the output projection's waits. Keeping made llama-1b's
    tp=4 step 6% shorter and gpt-2.7b's and llama-1b's tp=2 steps 1.1-1.5% shorter
    (docs/performance.md, "TP efficiency")."""
    return True if save_gathered_input is None else bool(save_gathered_input)


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group=None,
                          bias: Optional[torch.Tensor] = None,
                          held: Optional[HeldWork] = None) -> torch.Tensor:
    """reduce_scatter_along_seq(F.linear(h, weight)) + bias, the GEMMs overlapped with the reduce-scatter.

    h: [s, b, in/tp] (sequence-first); weight: [out, in/tp]; bias: [out] or None, added once per
    token in this rank's own GEMM (its gradient is this rank's tokens' part: a replicated bias
    needs its gradient summed over tp, e.g. through comm.copy_to_tp_region); returns this rank's
    summed tokens [s/tp, b, out]. held: work held for this layer's waits (tpflash.parallel.held_work),
    run in the forward while the last parts travel and in the backward while the peers' parts of
    grad_y do.
    Raises ValueError, before any collective, when s is not divisible by tp or the bias has the
    wrong size. Process group: `group`.
    """
    world = group_size(group)
    if world == 1:
        return torch.nn.functional.linear(h, weight, bias)
    if h.shape[0] % world:
        raise ValueError(f"sequence length {h.shape[0]} (dim 0 of {tuple(h.shape)}) is not divisible by tp={world}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the weight {tuple(weight.shape)}: "
                         f"it must be [{weight.shape[0]}] (one value per output feature)")
    return _RowLinearOverPeers.apply(h, weight, bias, group, held)
