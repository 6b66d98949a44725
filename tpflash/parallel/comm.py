"""Autograd-aware collectives over a tensor-parallel process group.

Every function takes the group explicitly; `group=None` (or a group of one) makes it the
identity, so layers built on these also run in a plain single-process script.

Forward / backward pairs (the duals of each other):
    copy_to_tp_region        identity        / all-reduce   (copy_to_tp_region_many: one for several,
                                                              e.g. a whole block's: tp_grad_aliases)
    reduce_from_tp_region    all-reduce      / identity
    split_along_dim          keep own chunk  / all-gather
    gather_along_dim         all-gather      / keep own chunk
    all_gather_along_seq     all-gather      / reduce-scatter   (sequence parallelism)
    reduce_scatter_along_seq reduce-scatter  / all-gather       (sequence parallelism)

`*_async` functions are the raw (non-autograd) primitives returning a `PendingCollective`
handle. All-gathers and
reduce-scatters of CUDA tensors may go through peer memory instead (tpflash.parallel.peer_collectives,
TPFLASH_COMM_BACKEND: by default inside CUDA-graph capture, and for a reduce-scatter asked to travel
beside the caller's next kernels; issued in stream order, so already "done").
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import peer_collectives
from .state import group_rank, group_size

ProcessGroup = Optional[dist.ProcessGroup]

# torch 2.13 renamed the single-tensor collectives; 2.11 (the GPU machines) has only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PendingCollective:
    """Handle of an in-flight collective; `wait()` blocks (on CUDA: orders the stream) and returns the result."""

    def __init__(self, work, result: torch.Tensor, finish: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        self._work, self._result, self._finish = work, result, finish

    def wait(self) -> torch.Tensor:
        """Wait for the collective (on CUDA the current stream waits, on CPU the host) and return its result."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._finish(self._result)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> None:
    if x.shape[dim] % world != 0:
        raise ValueError(f"{what}: size {x.shape[dim]} of dim {dim} (shape {tuple(x.shape)}) "
                         f"is not divisible by the group size {world}")


# The layers issue a few hundred collectives per training step, and torch.distributed's Python
# wrappers (argument checks, logging decorators, group lookups) cost tens of microseconds of host
# time each, which a tp=2 step on fast GPUs cannot hide. The ProcessGroup's own methods do the same
# collective without them; the wrappers remain the fallback for a torch that lacks those methods.
_PG_METHODS = all(hasattr(dist.ProcessGroup, m) for m in ("allreduce", "_allgather_base", "_reduce_scatter_base"))


def _issue_all_reduce(out: torch.Tensor, group) -> dist.Work:
    if _PG_METHODS and group is not None:
        return group.allreduce([out])  # SUM, in place
    return dist.all_reduce(out, group=group, async_op=True)


def _issue_all_gather(out: torch.Tensor, x: torch.Tensor, group) -> dist.Work:
    if _PG_METHODS and group is not None:
        return group._allgather_base(out, x)
    return all_gather_single(out, x, group=group, async_op=True)


def _issue_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> dist.Work:
    if _PG_METHODS and group is not None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return group._reduce_scatter_base(out, x, opts)
    return reduce_scatter_single(out, x, group=group, async_op=True)


_PG_COALESCED = all(hasattr(dist.ProcessGroup, m)
                    for m in ("allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"))


def all_gather_many(outs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], group: ProcessGroup) -> None:
    """outs[i] <- every rank's xs[i] concatenated in rank order (world * xs[i].numel() elements), for
    every i, as ONE grouped collective (NCCL: one launch); waits (the current stream, on CUDA)."""
    if _PG_COALESCED and group is not None:
        group.allgather_into_tensor_coalesced(list(outs), list(xs)).wait()
        return
    for out, x in zip(outs, xs):
        _issue_all_gather(out, x, group).wait()


def reduce_scatter_many(outs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], group: ProcessGroup) -> None:
    """outs[i] <- this rank's block of the sum over ranks of xs[i], for every i, as ONE grouped
    collective; waits (the current stream, on CUDA)."""
    if _PG_COALESCED and group is not None:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        group.reduce_scatter_tensor_coalesced(list(outs), list(xs), opts).wait()
        return
    for out, x in zip(outs, xs):
        _issue_reduce_scatter(out, x, group).wait()


def _through_peers(x: torch.Tensor, group: ProcessGroup, beside_compute: bool = False) -> bool:
    return peer_collectives.use_copy_engine(x, group, beside_compute)


def all_reduce_async(x: torch.Tensor, group: ProcessGroup) -> PendingCollective:
    """Sum `x` over the group into a new tensor (x itself is left alone)."""
    out = x.clone(memory_format=torch.contiguous_format)
    work = _issue_all_reduce(out, group) if group_size(group) > 1 else None
    return PendingCollective(work, out)


def all_gather_async(x: torch.Tensor, dim: int, group: ProcessGroup) -> PendingCollective:
    """Concatenate every rank's `x` along `dim` (rank order). [.., n, ..] -> [.., world*n, ..]"""
    world = group_size(group)
    if world == 1:
        return PendingCollective(None, x)
    dim = dim % x.dim()
    moved = x.movedim(dim, 0).contiguous()  # dim 0 gathers need no copy afterwards
    if _through_peers(moved, group):
        work, out = None, peer_collectives.all_gather(moved, group)
    else:
        out = moved.new_empty((world * moved.shape[0],) + moved.shape[1:])
        work = _issue_all_gather(out, moved, group)
    finish = (lambda t: t) if dim == 0 else (lambda t: t.movedim(0, dim).contiguous())
    return PendingCollective(work, out, finish)


def reduce_scatter_async(x: torch.Tensor, dim: int, group: ProcessGroup,
                         beside_compute: bool = False) -> PendingCollective:
    """Sum `x` over the group and keep this rank's chunk along `dim`. [.., world*n, ..] -> [.., n, ..]
    beside_compute: the caller issues kernels before `wait()` that the transfer should travel beside:
    where the copy engines reach the group (TPFLASH_COMM_BACKEND "auto" or "copy_engine") they push
    the parts on a side stream, taking no SMs from those kernels, and `wait()` adds them up."""
    world = group_size(group)
    if world == 1:
        return PendingCollective(None, x)
    dim = dim % x.dim()
    _check_divisible(x, dim, world, "reduce_scatter")
    moved = x.movedim(dim, 0).contiguous()
    to_dim = (lambda t: t) if dim == 0 else (lambda t: t.movedim(0, dim).contiguous())
    if beside_compute and _through_peers(moved, group, beside_compute=True):
        finish = peer_collectives.start_reduce_scatter(moved, group, peer_collectives.side_stream(moved.device))
        return PendingCollective(None, moved, lambda _: to_dim(finish()))
    if _through_peers(moved, group):
        work, out = None, peer_collectives.reduce_scatter(moved, group)
    else:
        out = moved.new_empty((moved.shape[0] // world,) + moved.shape[1:])
        work = _issue_reduce_scatter(out, moved, group)
    return PendingCollective(work, out, to_dim)


def all_reduce(x, group):
    """Sum of `x` over `group` (a new tensor; not autograd-aware: see reduce_from_tp_region)."""
    return all_reduce_async(x, group).wait()


def all_gather(x, dim, group):
    """Every rank's `x` concatenated along `dim` in rank order (not autograd-aware). [.., n, ..] -> [.., world*n, ..]"""
    return all_gather_async(x, dim, group).wait()


def reduce_scatter(x, dim, group):
    """The sum of `x` over `group`, this rank's chunk along `dim` (not autograd-aware).
    [.., world*n, ..] -> [.., n, ..]"""
    return reduce_scatter_async(x, dim, group).wait()


def split(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim` (no communication)."""
    world = group_size(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "split")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _CopyManyToRegion(torch.autograd.Function):
    """_CopyToRegion for several tensors: their gradients are all-reduced as one flat buffer per dtype."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return xs

    @staticmethod
    def backward(ctx, *grads):
        sums, by_dtype = list(grads), {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), ctx.group)
            for i, s in zip(idx, flat.split([grads[i].numel() for i in idx])):
                sums[i] = s.view_as(grads[i])
        return (None, *sums)


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, ctx.dim, ctx.group), None, None


class _AllGatherReduceScatter(torch.autograd.Function):
    """all-gather forward, reduce-scatter backward (or the reverse when `gather=False`)."""

    @staticmethod
    def forward(ctx, x, dim, group, gather):
        ctx.dim, ctx.group, ctx.gather = dim, group, gather
        return all_gather(x, dim, group) if gather else reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        g = reduce_scatter(grad, ctx.dim, ctx.group) if ctx.gather else all_gather(grad, ctx.dim, ctx.group)
        return g, None, None, None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel layer)."""
    return x if group_size(group) == 1 else _CopyToRegion.apply(x, group)


def copy_to_tp_region_many(xs: Sequence[torch.Tensor], group: ProcessGroup) -> Tuple[torch.Tensor, ...]:
    """copy_to_tp_region of each tensor, with all their gradients summed in ONE all-reduce per dtype (a
    norm's weight and bias under SP: the collective's latency, not its bytes, is its cost)."""
    return tuple(xs) if group_size(group) == 1 or not xs else tuple(_CopyManyToRegion.apply(group, *xs))


def tp_grad_aliases(params: Sequence[torch.Tensor], group: ProcessGroup) -> Dict[int, torch.Tensor]:
    """id(p) -> an alias of p (identity forward) for each p in params, all their gradients summed over
    tp by ONE all-reduce per dtype, once the last of them is known (e.g. a block's norm weights and
    row-layer biases under sequence parallelism: the aliases are made where the forward starts, so
    their backward runs last), instead of one all-reduce per use. Every use of p in the forward must
    take the alias (tpflash.layers.block_weights hands them to a block's layers). {} at tp=1.
    Process group: `group`."""
    if group_size(group) == 1 or not params:
        return {}
    return {id(p): alias for p, alias in zip(params, _CopyManyToRegion.apply(group, *params))}


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward (output of a row-parallel layer)."""
    return x if group_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def split_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Keep this rank's chunk along `dim` forward; all-gather the gradient backward."""
    return x if group_size(group) == 1 else _SplitAlongDim.apply(x, dim, group)


def gather_along_dim(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """All-gather along `dim` forward; keep this rank's chunk of the gradient backward."""
    return x if group_size(group) == 1 else _GatherAlongDim.apply(x, dim, group)


def all_gather_along_seq(x: torch.Tensor, group: ProcessGroup, seq_dim: int = 0) -> torch.Tensor:
    """Sequence parallelism: [seq/tp, ...] -> [seq, ...] forward; reduce-scatter of the gradient backward.

    The gradient is reduced because each rank's consumer (a column-parallel GEMM) contributes
    a partial gradient for every token.
    """
    return x if group_size(group) == 1 else _AllGatherReduceScatter.apply(x, seq_dim, group, True)


def reduce_scatter_along_seq(x: torch.Tensor, group: ProcessGroup, seq_dim: int = 0) -> torch.Tensor:
    """Sequence parallelism: partial sums [seq, ...] -> summed [seq/tp, ...]; all-gather backward."""
    return x if group_size(group) == 1 else _AllGatherReduceScatter.apply(x, seq_dim, group, False)
