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
  reduce-scatter's parts travel (tpflash.parallel.overlap_gemms).

Holding a gradient is sound only where nothing reads it before the GEMM fills it: inside the
capture of a CUDA graph of the blocks (GraphedBlocks), which differentiates them with
torch.autograd.grad and returns every gradient after its backward, and with no per-parameter
hooks (sharded data parallelism reduces gradients as they come). GraphedBlocks allows it for the
capture (`holding_gradients`) and runs what is left at the end of the backward; anywhere else a
layer computes its weight gradient at once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Sequence


class HeldWork:
    """The work one block holds (`hold`) for its output projection to run (`run`), in the order held.
    A block makes one and hands it to its MLP (which may hold its weight gradient) and to its output
    projection (which runs it). `holds_gradients`: whether a weight gradient may be held now
    (`holding_gradients`)."""

    def __init__(self):
        self.holds_gradients = False
        self.pending: List[Callable[[], None]] = []

    def hold(self, work: Callable[[], None]) -> None:
        """Keep `work` (kernels to issue on the current stream) for `run`."""
        self.pending.append(work)

    def run(self) -> None:
        """Issue the held work, in the order held, on the current stream."""
        pending, self.pending = self.pending, []
        for work in pending:
            work()


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
