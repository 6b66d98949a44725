"""A block's weights cast to the compute dtype by one multi-tensor copy per forward, not one cast each.

Under autocast every GEMM multiplies bf16 copies of fp32 weights. Cast one by one, that is about ten
small copy kernels per block and step (gpt-2.7b: 354 per step), each with its launch, and inside a
CUDA graph a dependency gap after it (docs/architecture.md, "Layers and data flow"). `prepare_cast(groups,
dtype)` lays out one buffer for all of them, each group of tensors side by side, so that a group
multiplied as one stacked weight (q/k/v, up/gate: tpflash.layers.autocast_linear) is a view of it too;
its `fill()` issues the copy (`torch._foreach_copy_`, a few multi-tensor kernels). The block hands the
resulting `PendingCast` to its layers for one forward (tpflash.layers.block_weights), and the layers
pass it to `stacked_cast`: a view from it, else the usual cast and copy.

Tensors are recognised by storage address and shape, so an alias of a parameter (e.g. from
tpflash.parallel.comm.tp_grad_aliases) finds the parameter's cast. The casts are valid while the
tensors do not change, i.e. within one forward; the layers' backward uses the copies it saved.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch


def _key(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)


def compute_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype the layers will multiply in for input x: autocast's, while autocast and gradients are
    on (the case where the layers cast their fp32 weights themselves), else None."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device) and torch.is_grad_enabled():
        return torch.get_autocast_dtype(device)
    return None


class PendingCast:
    """One buffer of `dtype` views of some groups of tensors (`prepare_cast`), with the copy that fills
    it not yet issued: `fill()` issues it (once; later calls do nothing), on the current stream, and
    must come before any kernel reads the views. `cast_now` fills it at once; GraphedBlocks issues a
    block's copy later, in the previous block's waits (tpflash.parallel.held_work)."""

    def __init__(self, dtype: torch.dtype, cache: Dict[tuple, torch.Tensor], views: List[torch.Tensor],
                 tensors: List[torch.Tensor]):
        self.dtype, self.cache, self.views, self.tensors, self.filled = dtype, cache, views, tensors, False

    def view(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The tensors' cast to `dtype`, stacked along dim 0, where this buffer holds them as one of its
        groups (or one tensor of a group), else None."""
        return self.cache.get(_key(tensors)) if dtype == self.dtype else None

    def fill(self, again: bool = False) -> None:
        """Issue the copy, unless it was issued already (again=True: issue it anyway, e.g. after the
        tensors changed)."""
        if again or not self.filled:
            with torch.no_grad():
                torch._foreach_copy_(self.views, self.tensors)
            self.filled = True


def prepare_cast(groups: Sequence[Sequence[Optional[torch.Tensor]]], dtype: Optional[torch.dtype]) -> Optional[PendingCast]:
    """One buffer for the `dtype` casts of `groups`, its copy not yet issued. groups: tuples of tensors
    whose shapes agree past dim 0 (e.g. (W_q, W_k, W_v), (b_q, b_k, b_v), (W_o,)); groups holding
    None, tensors already in `dtype`, non-contiguous tensors and another device than the first's
    are left out. None where nothing is cast (dtype None, or no group castable)."""
    if dtype is None:
        return None
    kept, device = [], None
    for g in groups:
        if not g or not all(_castable(t, dtype) for t in g):
            continue
        device = g[0].device if device is None else device
        if all(t.device == device for t in g):
            kept.append(tuple(g))
    if not kept:
        return None
    tensors = [t for g in kept for t in g]
    sizes = [t.numel() for t in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    views = [piece.view(t.shape) for piece, t in zip(flat.split(sizes), tensors)]
    cache, start, offset = {}, 0, 0
    for g in kept:
        numel = sum(sizes[start:start + len(g)])
        keys = _key(g)  # ((data_ptr, shape), ...) per tensor, as view() looks them up
        for key, view in zip(keys, views[start:start + len(g)]):
            cache[(key,)] = view
        if len(g) > 1 and all(t.shape[1:] == g[0].shape[1:] for t in g):  # stackable along dim 0
            shape = (sum(t.shape[0] for t in g),) + tuple(g[0].shape[1:])
            cache[keys] = flat[offset:offset + numel].view(shape)
        start, offset = start + len(g), offset + numel
    return PendingCast(dtype, cache, views, tensors)


def cast_now(groups: Sequence[Sequence[Optional[torch.Tensor]]], dtype: Optional[torch.dtype]) -> Optional[PendingCast]:
    """`prepare_cast(groups, dtype)` with its copy issued now (None where nothing is cast)."""
    cast = prepare_cast(groups, dtype)
    if cast is not None:
        cast.fill()
    return cast


def _castable(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    return t is not None and t.is_floating_point() and t.dtype != dtype and t.is_contiguous() and t.numel() > 0


def cached_cast(tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                casts: Optional[PendingCast]) -> Optional[torch.Tensor]:
    """The tensors' stacked cast to `dtype` from `casts` where it holds them, else None."""
    return None if casts is None else casts.view(tensors, dtype)


def adjacent_rows(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """One view of the tensors stacked along dim 0 where they already are, in `dtype`, one after the
    other in one storage (fsdp=zero3's gathered weights: tpflash.parallel.zero3), else None. Not
    differentiable: for the layers' own autograd Functions, which compute each tensor's gradient."""
    first = tensors[0]
    if first.dtype != dtype:
        return None
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if (t.dtype != dtype or not t.is_contiguous() or t.shape[1:] != first.shape[1:] or t.device != first.device
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != end):
            return None
        end += t.numel() * t.element_size()
    shape = (sum(t.shape[0] for t in tensors),) + tuple(first.shape[1:])
    return first.detach().as_strided(shape, torch.empty(shape, device="meta").stride())


def stacked_cast(tensors: Sequence[torch.Tensor], dtype: torch.dtype,
                 casts: Optional[PendingCast] = None) -> torch.Tensor:
    """The tensors concatenated along dim 0 in `dtype`: a view of `casts` (a block's casts for this
    forward) where it holds them, a view of their storage where they lie there stacked in `dtype`
    already, else cast and copied in one pass each."""
    cached = cached_cast(tensors, dtype, casts)
    if cached is not None:
        return cached
    if len(tensors) == 1:
        return tensors[0].to(dtype)
    adjacent = adjacent_rows(tensors, dtype)
    if adjacent is not None:
        return adjacent
    out = torch.empty((sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:]),
                      dtype=dtype, device=tensors[0].device)
    for part, t in zip(out.split([t.shape[0] for t in tensors]), tensors):
        part.copy_(t)
    return out
