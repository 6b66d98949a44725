"""A block's weights cast to the compute dtype by one multi-tensor copy per forward, not one cast each.

Under autocast every GEMM multiplies bf16 copies of fp32 weights. Cast one by one, that is about ten
small copy kernels per block and step (gpt-2.7b: 354 per step), each with its launch, and inside a
CUDA graph a dependency gap after it (docs/architecture.md, "Layers and data flow"). Inside `cast_once(groups,
dtype)` those casts are done on entry by `torch._foreach_copy_` (a few multi-tensor kernels for all
of them) into one buffer, each group of tensors side by side, so that a group multiplied as one
stacked weight (q/k/v, up/gate: tpflash.layers.autocast_linear) is a view of it too. `stacked_cast`
is what the layers call: a view from the open cast, else the usual cast and copy.

Tensors are recognised by storage address and shape, so an alias of a parameter (e.g. from
tpflash.parallel.comm.tp_grad_bucket) finds the parameter's cast. The casts are valid while the
tensors do not change, i.e. within one forward; the layers' backward uses the copies it saved.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

_open_casts: List[Tuple[torch.dtype, Dict[tuple, torch.Tensor]]] = []  # innermost last: key -> cast view


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
    """One buffer of cast views for some groups of tensors (see `cast_once`), with the copy that fills
    it not yet issued: `fill()` issues it (once; later calls do nothing), on the current stream, and
    must come before any kernel reads the views. `prepare_cast` makes one; `cast_once` fills it at
    once, `open_casts` lets GraphedBlocks issue the copy later (a block's casts in the previous
    block's waits: tpflash.parallel.held_work)."""

    def __init__(self, cache: Dict[tuple, torch.Tensor], views: List[torch.Tensor], tensors: List[torch.Tensor]):
        self.cache, self.views, self.tensors, self.filled = cache, views, tensors, False

    def fill(self, again: bool = False) -> None:
        """Issue the copy, unless it was issued already (again=True: issue it anyway, e.g. after the
        tensors changed)."""
        if again or not self.filled:
            with torch.no_grad():
                torch._foreach_copy_(self.views, self.tensors)
            self.filled = True


def prepare_cast(groups: Sequence[Sequence[Optional[torch.Tensor]]], dtype: Optional[torch.dtype]) -> Optional[PendingCast]:
    """The buffer and views `cast_once(groups, dtype)` would fill, unfilled; None where nothing is cast
    (dtype None, or no group castable: see cast_once)."""
    if dtype is None:
        return None
    kept, device = [], None
    for g in groups:
        if not g or not all(_castable(t, dtype) for t in g):
            continue
        device = g[0].device if device is None else device
        if all(t.device == device for t in g) and _lookup(g, dtype) is None:
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
        keys = _key(g)  # ((data_ptr, shape), ...) per tensor, as _lookup builds them
        for key, view in zip(keys, views[start:start + len(g)]):
            cache[(key,)] = view
        if len(g) > 1 and all(t.shape[1:] == g[0].shape[1:] for t in g):  # stackable along dim 0
            shape = (sum(t.shape[0] for t in g),) + tuple(g[0].shape[1:])
            cache[keys] = flat[offset:offset + numel].view(shape)
        start, offset = start + len(g), offset + numel
    return PendingCast(cache, views, tensors)


@contextlib.contextmanager
def open_casts(casts: Sequence[Optional[PendingCast]], dtype: Optional[torch.dtype]):
    """Inside, `stacked_cast` finds the views of every cast given (None entries skipped), filled or not:
    the caller issues each one's `fill()` before the layers that read it run."""
    caches = [c.cache for c in casts if c is not None]
    if dtype is None or not caches:
        yield
        return
    _open_casts.append((dtype, {key: view for cache in caches for key, view in cache.items()}))
    try:
        yield
    finally:
        _open_casts.pop()


@contextlib.contextmanager
def cast_once(groups: Sequence[Sequence[Optional[torch.Tensor]]], dtype: Optional[torch.dtype]):
    """Inside, `stacked_cast(group, dtype)` of any group here (or of one of its tensors) returns a view
    of one buffer filled on entry by one multi-tensor copy. groups: tuples of tensors whose shapes
    agree past dim 0 (e.g. (W_q, W_k, W_v), (b_q, b_k, b_v), (W_o,)); groups holding None, tensors
    already in `dtype`, non-contiguous tensors, another device than the first's, and groups an
    enclosing cast_once holds already are left out.
    dtype None: nothing is cast (a no-op context)."""
    cast = prepare_cast(groups, dtype)
    if cast is not None:
        cast.fill()
    with open_casts([cast], dtype):
        yield


def _castable(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    return t is not None and t.is_floating_point() and t.dtype != dtype and t.is_contiguous() and t.numel() > 0


def cached_cast(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The tensors' stacked cast to `dtype` from the innermost open `cast_once` holding them, else None."""
    return _lookup(tensors, dtype)


def _lookup(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    if not _open_casts:
        return None
    key = _key(tensors)
    for cast_dtype, cache in reversed(_open_casts):
        if cast_dtype == dtype and key in cache:
            return cache[key]
    return None


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


def stacked_cast(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensors concatenated along dim 0 in `dtype`: a view of the innermost open `cast_once` that
    holds them, a view of their storage where they lie there stacked in `dtype` already, else cast
    and copied in one pass each."""
    cached = cached_cast(tensors, dtype)
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
