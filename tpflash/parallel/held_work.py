"""Work held back to fill the waits of a block's output projection.

Under the overlapped sequence-parallel layers, the attention's output projection waits on the copy
engines in both directions: in the forward its own GEMMs are done before the last parts of its
reduce-scatter arrive, and in the backward each peer's part of the gathered grad_y takes longer to
arrive than the small GEMM that consumes it (docs/performance.md, "TP
efficiency"). A block's `HeldWork` collects work that does not depend on those transfers and is
due later anyway, and the output projection runs it in the wait:

- forward: the next block's weight casts (GraphedBlocks hands them over: weight_casts.PendingCast);
- backward: the MLP's up-projection weight-gradient GEMM over its kept input. That layer's backward
  runs just before, returns the gradient unfilled and multiplies its own rows while its
  reduce-scatter's parts travel (tpflash.parallel.overlap_gemms). Where the down projection's
  weight gradient has the same shape (ffn_hidden / tp == hidden, e.g. a GPT's 4x MLP at tp=4), the
  down projection holds its GEMM too, over its output gradient kept from its backward's gather, and
  the two run as one batched GEMM (tpflash.kernels.batched_weight_grad): a [hidden x hidden]
  gradient alone fills the GPU's SMs for one and a half waves.

Holding a gradient is sound only where nothing reads it before the GEMM fills it: inside the
capture of a CUDA graph of the blocks (GraphedBlocks), which differentiates them with
torch.autograd.grad and returns every gradient after its backward, and with no per-parameter
hooks (sharded data parallelism reduces gradients as they come). GraphedBlocks allows it for the
capture (`holding_gradients`) and runs what is left at the end of the backward; anywhere else a
layer computes its weight gradient at once.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Union

import torch

from ..kernels.batched_weight_grad import MAX_BATCH, weight_grads_fp32


@dataclass
class WeightGrad:
    """A held weight gradient grad_y^T x in fp32 (kernels.weight_grad_fp32): added into `into` or written
    into `out`."""
    grad_y: torch.Tensor  # [rows, out]
    x: torch.Tensor  # [rows, in]
    into: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None

    def batches_with(self, other: "WeightGrad") -> bool:
        """Whether the two can be one batched GEMM: the same shapes, dtypes and mode (add or write)."""
        return (self.grad_y.shape == other.grad_y.shape and self.x.shape == other.x.shape
                and self.grad_y.dtype == other.grad_y.dtype and (self.into is None) == (other.into is None))


class HeldWork:
    """The work one block holds (`hold`, `hold_weight_grad`) for its output projection to run (`run`),
    in the order held. A block makes one and hands it to its MLP (which may hold its weight gradients)
    and to its output projection (which runs it). `holds_gradients`: whether a weight gradient may be
    held now (`holding_gradients`)."""

    def __init__(self):
        self.holds_gradients = False
        self.pending: List[Union[Callable[[], None], WeightGrad]] = []

    def hold(self, work: Callable[[], None]) -> None:
        """Keep `work` (kernels to issue on the current stream) for `run`."""
        self.pending.append(work)

    def hold_weight_grad(self, grad_y: torch.Tensor, x: torch.Tensor, into: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None) -> None:
        """Keep the weight gradient grad_y^T x (added into `into`, or written into `out`) for `run`, which
        computes it in one batched GEMM with the other held ones of its shape."""
        self.pending.append(WeightGrad(grad_y, x, into, out))

    def run(self) -> None:
        """Issue the held work on the current stream, in the order held; weight gradients of one shape as
        one batched GEMM (kernels.batched_weight_grad), at the place of the first of them."""
        pending, self.pending = self.pending, []
        for i, work in enumerate(pending):
            if work is None:  # already in an earlier batch
                continue
            if not isinstance(work, WeightGrad):
                work()
                continue
            batch = [work]
            for j in range(i + 1, len(pending)):
                other = pending[j]
                if len(batch) < MAX_BATCH and isinstance(other, WeightGrad) and other.batches_with(work):
                    batch.append(other)
                    pending[j] = None
            results = [w.into if w.into is not None else w.out for w in batch]
            weight_grads_fp32([w.grad_y for w in batch], [w.x for w in batch],
                              into=results if work.into is not None else None,
                              out=results if work.into is None else None)


@contextlib.contextmanager
def holding_gradients(held: Sequence[HeldWork]) -> Iterator[None]:
    """Weight gradients may be held for `held` (GraphedBlocks' warm-up and capture of the backward);
    whatever is still held when the block ends is run then, inside the capture, so that no gradient
    stays unfilled. If the block fails, what it held is dropped."""
    for h in held:
        h.holds_gradients = True
    try:
        yield
        for h in held:
            h.run()
    finally:
        for h in held:
            h.holds_gradients, h.pending = False, []
