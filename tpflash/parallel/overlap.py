"""Sequence-parallel GEMMs with their collectives pipelined (chunked collective-matmul).

Under sequence parallelism a column-parallel GEMM needs the all-gathered input and a
row-parallel GEMM ends in a reduce-scatter. Done naively the GPU waits for each collective.
Here each rank's sequence shard is cut into k pieces (rows [j*m, (j+1)*m) of its [s/tp, b, feat]
block, m = s/(tp*k)), and every piece is its own asynchronous NCCL/gloo collective, so that the
GEMM on one piece runs while the next piece travels:

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

On CUDA the collectives run on NCCL's own stream (the "side stream"); `Work.wait()` makes the
compute stream wait on an event, so the GEMM of piece j runs while piece j+1 is in flight. On
CPU/gloo the same code runs with asynchronous work handles, which is what the tests exercise.
(A first version passed whole tp-chunks around a ring of NCCL send/recv; on 2 H200s it was
slower than no overlap at all, see docs/overlap.md, so pieces now go through NCCL's collectives.)

The switch: TPFLASH_OVERLAP=1/0, or `overlap_comm(True/False)` inside a `with` block; layers built
with `overlap=None` ask at every forward (`resolve_overlap`). Unset, overlap is on only for the work
CUDA graphs capture over GPUs that map each other's memory, with the "copy_engine" backend (one GEMM
per rank's rows beside copy-engine transfers, tpflash.parallel.peer_overlap), the one variant
measured faster than serial collectives. Results are the same either way up to the order of
floating-point sums. TPFLASH_OVERLAP_BACKEND picks "pieces" (this module; TPFLASH_OVERLAP_PIECES
sets k, 4), "symm_mem" (PyTorch's symmetric-memory collective matmuls, tpflash.parallel.symm_overlap),
"copy_engine", or "auto" (default: copy_engine where the copy engines reach, else pieces).
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..layers.weight_casts import stacked_cast
from . import comm, peer_collectives
from .state import group_size

_ENV = "TPFLASH_OVERLAP"
_forced: List[bool] = []  # stack of `overlap_comm` settings; the innermost wins


def _explicit_setting() -> Optional[bool]:
    """The innermost `overlap_comm` setting, else TPFLASH_OVERLAP ("1"/"true"/"on"/"yes" on, anything
    else off), else None (unset)."""
    if _forced:
        return _forced[-1]
    env = os.environ.get(_ENV, "").strip().lower()
    return (env in ("1", "true", "on", "yes")) if env else None


def overlap_enabled() -> bool:
    """Whether overlap was asked for everywhere: the innermost `overlap_comm` setting, else
    TPFLASH_OVERLAP, else False. (Unasked, `resolve_overlap` still overlaps the work CUDA graphs
    capture where the copy engines can carry it: its docstring.)"""
    return bool(_explicit_setting())


def num_pieces(rows: int, want: Optional[int] = None) -> int:
    """k: the largest divisor of `rows` (this rank's sequence length) not above `want`
    (default TPFLASH_OVERLAP_PIECES, else 4)."""
    want = int(os.environ.get("TPFLASH_OVERLAP_PIECES", "4")) if want is None else want
    return max(d for d in range(1, max(1, min(want, rows)) + 1) if rows % d == 0)


@contextlib.contextmanager
def overlap_comm(enabled: bool = True):
    """Within the block, layers built with overlap=None use (or, with False, skip) the pipelined path."""
    _forced.append(bool(enabled))
    try:
        yield
    finally:
        _forced.pop()


_BACKENDS = ("auto", "pieces", "symm_mem", "copy_engine")


def overlap_backend(x: Optional[torch.Tensor] = None, group=None) -> str:
    """How overlapped layers communicate (TPFLASH_OVERLAP_BACKEND): "copy_engine" (one GEMM per rank's
    rows beside copy-engine transfers, tpflash.parallel.peer_overlap; where the GPUs cannot map each
    other's memory, the same GEMMs over the group's collectives, not overlapped), "pieces" (this
    module's NCCL/gloo collectives per piece) or "symm_mem" (PyTorch's symmetric-memory collective
    matmuls, tpflash.parallel.symm_overlap; CUDA only, "pieces" elsewhere). "auto" (the default):
    "copy_engine" for x over group where its GPUs map each other's memory and TPFLASH_COMM_BACKEND
    is not "nccl" (the only variant measured faster than serial collectives: docs/overlap.md),
    else "pieces". With no x, "auto" itself."""
    backend = os.environ.get("TPFLASH_OVERLAP_BACKEND", "auto").strip().lower()
    if backend not in _BACKENDS:
        raise ValueError(f"TPFLASH_OVERLAP_BACKEND={backend!r} must be one of {_BACKENDS}")
    if backend == "auto" and x is not None:
        return "copy_engine" if _copy_engines_reach(x, group) else "pieces"
    return backend


def _copy_engines_reach(x: torch.Tensor, group) -> bool:
    return peer_collectives.comm_backend() != "nccl" and peer_collectives.reachable(x, group)


def _use_symm_mem(x: torch.Tensor, group) -> bool:
    if overlap_backend(x, group) != "symm_mem":
        return False
    from . import symm_overlap
    return symm_overlap.available(x)


def resolve_overlap(flag: Optional[bool], x: Optional[torch.Tensor] = None, group=None) -> bool:
    """Whether a layer pipelines its collectives now: its explicit `overlap` flag, else the global
    setting (`overlap_comm`, TPFLASH_OVERLAP), else the default: on for the work CUDA graphs capture
    (GraphedBlocks: `peer_collectives.for_graph_capture`) when the "copy_engine" backend serves x over
    group with the copy engines; off elsewhere, where no variant measured faster than serial
    collectives (docs/overlap.md). x/group: the layer's input and tp group (None: no default)."""
    if flag is not None:
        return bool(flag)
    setting = _explicit_setting()
    if setting is not None:
        return setting
    return (x is not None and peer_collectives.capturing_for_graphs()
            and overlap_backend(x, group) == "copy_engine" and _copy_engines_reach(x, group))


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


# ---- dtype handling under autocast -----------------------------------------------------------------

def linear_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in for input x here: the autocast dtype when autocast is on
    (autocast leaves float64 alone), else x's."""
    dev = x.device.type
    if (dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and x.is_floating_point()
            and x.dtype != torch.float64):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else stacked_cast([t], dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[*, feat] -> [rows, feat] (a view when t is contiguous)."""
    return t.reshape(-1, t.shape[-1])


def _no_autocast(x: torch.Tensor):
    return torch.autocast(x.device.type, enabled=False)


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


# ---- public entry points ---------------------------------------------------------------------------

def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Optional[Sequence[Optional[torch.Tensor]]] = None, group=None,
                      save_gathered_input: Optional[bool] = None) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i) for each i], the gather pipelined with the GEMMs.

    x_local: [s/tp, b, in] (sequence-first, this rank's tokens); W_i: [out_i/tp, in]; returns
    [s, b, out_i/tp] per weight. Several weights share one gathered input (q/k/v, up/gate).
    save_gathered_input=False keeps only x_local for backward (1/tp of the memory) and re-gathers
    it there, hidden behind the input-gradient GEMMs; None (default): the backend's choice, which
    re-gathers under "copy_engine" (the transfer rides on the copy engines) and keeps the gathered
    input otherwise (an NCCL all-gather would take SMs from the GEMMs). Process group: `group`
    (None: tp=1).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases")
    if group_size(group) == 1:
        return [torch.nn.functional.linear(x_local, w, b) for w, b in zip(weights, biases)]
    all_or_no_bias = len({b is None for b in biases}) == 1
    if overlap_backend(x_local, group) == "copy_engine" and all_or_no_bias:
        from . import peer_overlap
        return peer_overlap.all_gather_linear(x_local, weights, biases, group, bool(save_gathered_input))
    save_gathered_input = True if save_gathered_input is None else save_gathered_input
    if _use_symm_mem(x_local, group):
        from . import symm_overlap
        return symm_overlap.all_gather_linear(x_local, weights, biases, group)
    return list(_AllGatherLinear.apply(x_local, group, save_gathered_input, *weights, *biases))


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group=None,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reduce_scatter_along_seq(F.linear(h, weight)) + bias, the GEMM pipelined with the reduce-scatter.

    h: [s, b, in/tp] (sequence-first); weight: [out, in/tp]; bias: [out] or None, added once to the
    sum in the output's dtype (its gradient is this rank's tokens' part: a replicated bias needs
    its gradient summed over tp, e.g. through comm.copy_to_tp_region); returns this rank's summed
    tokens [s/tp, b, out]. Raises ValueError when s is not divisible by tp. Process group: `group`.
    """
    world = group_size(group)
    if world == 1:
        return torch.nn.functional.linear(h, weight, bias)
    if h.shape[0] % world:
        raise ValueError(f"sequence length {h.shape[0]} (dim 0 of {tuple(h.shape)}) is not divisible by tp={world}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the weight {tuple(weight.shape)}: "
                         f"it must be [{weight.shape[0]}] (one value per output feature)")
    if overlap_backend(h, group) == "copy_engine":  # the bias rides in this rank's own GEMM's epilogue
        from . import peer_overlap
        return peer_overlap.linear_reduce_scatter(h, weight, group, bias)
    if _use_symm_mem(h, group):
        from . import symm_overlap
        y = symm_overlap.linear_reduce_scatter(h, weight, group)
    else:
        y = _LinearReduceScatter.apply(h, weight, group)
    from ..layers.autocast_linear import add_bias  # layers import this module
    return add_bias(y, bias)
