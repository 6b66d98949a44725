"""fp32 buffers that the weight-gradient GEMMs add into, so that micro-batches accumulate in the GEMMs.

Accumulating gradients over k micro-batches, autograd adds each micro-batch's weight gradient into
`.grad`: the GEMM writes the gradient (4 bytes a parameter), then one more pass reads it and `.grad`
and writes `.grad` (12 bytes), and the first micro-batch's gradients are copied out of the CUDA
graphs' memory. Here each fp32 weight gets a buffer of its own, `weight.main_grad` (the name
Megatron-LM gives the same idea), the weights a layer stacks into one GEMM (q/k/v, up/gate) side by
side in one flat buffer, and the weight-gradient GEMM adds into it in its epilogue (beta=1:
tpflash.kernels.weight_grad_fp32(into=)). The layer then returns no gradient for those weights, and
`.grad` is the buffer itself.

`MainGrads` gives the weights their buffers for the work run inside `open()`: a layer's forward asks
`main_grad_of(weights)` once (at capture, for a CUDA graph) and its backward adds into what it got.
Before each backward `start()` makes every buffer hold its weight's `.grad` (zeros where there is
none, e.g. after `zero_grad(set_to_none=True)`) and makes `.grad` the buffer. GraphedBlocks uses
them where its caller says micro-batches accumulate (docs/performance.md, "TP efficiency").
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


def _takes_main_grad(w: Optional[torch.Tensor]) -> bool:
    return (isinstance(w, torch.nn.Parameter) and w.requires_grad and w.dtype == torch.float32
            and w.dim() == 2 and w.is_contiguous())


class MainGrads:
    """One flat fp32 buffer holding a `main_grad` [out, in] for every 2-D fp32 weight of `groups`,
    each group's weights side by side in its order (a group: the weights one GEMM stacks by rows).
    Groups holding anything else (biases, norms, None) are left out, as is a weight already placed."""

    def __init__(self, groups: Sequence[Sequence[Optional[torch.Tensor]]]):
        placed, seen = [], set()
        for group in groups:
            if group and all(_takes_main_grad(w) for w in group) and not any(id(w) in seen for w in group):
                placed.extend(group)
                seen.update(id(w) for w in group)
        self.weights: List[torch.nn.Parameter] = placed
        if not placed:
            self.flat, self.buffers = None, []
            return
        sizes = [w.numel() for w in placed]
        self.flat = torch.zeros(sum(sizes), dtype=torch.float32, device=placed[0].device)
        self.buffers = [piece.view(w.shape) for piece, w in zip(self.flat.split(sizes), placed)]

    def keep_only(self, weights: Sequence[torch.Tensor]) -> None:
        """Forget the weights not in `weights` (their layers returned gradients after all): start() leaves
        their .grad alone. Their part of the flat buffer stays unused."""
        kept = {id(w) for w in weights}
        pairs = [(w, b) for w, b in zip(self.weights, self.buffers) if id(w) in kept]
        self.weights, self.buffers = [w for w, _ in pairs], [b for _, b in pairs]

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """Inside, every weight carries its buffer as `weight.main_grad` (for main_grad_of)."""
        for w, b in zip(self.weights, self.buffers):
            w.main_grad = b
        try:
            yield
        finally:
            for w in self.weights:
                del w.main_grad

    def start(self) -> None:
        """Before a backward that adds into the buffers: each buffer holds its weight's .grad (zeros where
        .grad is None), and .grad is the buffer. Nothing to do while they already are (the micro-batches
        after the first)."""
        stale = [(w, b) for w, b in zip(self.weights, self.buffers) if w.grad is not b]
        if not stale:
            return
        if len(stale) == len(self.buffers) and all(w.grad is None for w, _ in stale):
            self.flat.zero_()  # one memset (also over buffers no longer kept)
        else:
            for w, b in stale:
                b.zero_() if w.grad is None else b.copy_(w.grad)
        for w, b in stale:
            w.grad = b


def main_grad_of(weights: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The fp32 buffer [sum out_i, in] that the weight-gradient GEMM of `weights` (stacked by rows, in this
    order) may add into: their `main_grad`s where every weight has one and they lie side by side in one
    storage in this order (MainGrads places a group so); else None (the layer returns gradients)."""
    buffers = [getattr(w, "main_grad", None) for w in weights]
    if any(b is None for b in buffers):
        return None
    first, end = buffers[0], buffers[0].data_ptr()
    for b in buffers:
        if (b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or b.data_ptr() != end
                or b.shape[1:] != first.shape[1:]):
            return None
        end += b.numel() * b.element_size()
    rows = sum(b.shape[0] for b in buffers)
    return first.as_strided((rows,) + tuple(first.shape[1:]), first.stride())


def split_or_none(main_grad: Optional[torch.Tensor], grad_w: torch.Tensor, sizes: Sequence[int]
                  ) -> Tuple[Optional[torch.Tensor], ...]:
    """A stacked weight gradient's per-weight parts for autograd: none where it went into `main_grad`."""
    if main_grad is not None:
        return (None,) * len(sizes)
    return tuple(grad_w.split(list(sizes)))
