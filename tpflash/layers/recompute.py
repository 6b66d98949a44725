"""Save how to remake a cheap tensor instead of the tensor itself.

The MLP's activation output h = act(up(x)) (or silu(gate) * up) is as large as the up projection's
output and is kept for the down projection's weight gradient, though one elementwise pass over
tensors the activation's own backward keeps anyway remakes it. `recomputed_when_saved(h, remake)`
makes autograd save, for every view of h saved inside it, a recipe instead of the tensor; the
backward remakes h once (remake()) when it first needs it, and frees it with the last node that
saved it. The values are the same bits: the forward's kernel runs again on the same inputs.
Saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks) are scoped to the block, and nothing
else saved there is touched.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn


class _Remade:
    """h, remade on first use and shared by every saved view of it."""

    def __init__(self, remake: Callable[[], torch.Tensor]):
        self.remake, self.value = remake, None

    def get(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.remake()
        return self.value


class _SavedView:
    """A saved view of h: its geometry relative to h, and the shared remade h."""

    __slots__ = ("source", "size", "stride", "offset")

    def __init__(self, source: _Remade, view: torch.Tensor, base_offset: int):
        self.source, self.size, self.stride = source, view.size(), view.stride()
        self.offset = view.storage_offset() - base_offset

    def tensor(self) -> torch.Tensor:
        h = self.source.get()
        return h.as_strided(self.size, self.stride, h.storage_offset() + self.offset)


@contextlib.contextmanager
def recomputed_when_saved(output: torch.Tensor, remake: Optional[Callable[[], torch.Tensor]]) -> Iterator[None]:
    """Within the block, autograd saves views of `output` (a tensor with its own storage, e.g. a kernel's
    fresh output) as recipes; the backward gets remake()'s result, which must equal `output` (same
    shape, contiguous, same bits). remake None: a plain block, everything saved as usual."""
    if remake is None:
        yield
        return
    # what identifies output's views, not output itself: the hooks must not keep it alive
    storage, base_offset = output.untyped_storage().data_ptr(), output.storage_offset()
    dtype, device = output.dtype, output.device
    source = _Remade(remake)

    def pack(t: torch.Tensor):
        if (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == dtype and t.device == device
                and t.untyped_storage().data_ptr() == storage):  # subclasses (DTensor) pass as they are
            return _SavedView(source, t, base_offset)
        return t

    def unpack(saved):
        return saved.tensor() if isinstance(saved, _SavedView) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
