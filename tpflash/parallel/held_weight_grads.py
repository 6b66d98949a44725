"""Weight-gradient GEMMs held back from one layer's backward to fill the waits of a later one.

In a block's backward under overlapped sequence parallelism, the output projection's all-gather of
grad_y leaves the GPU idle between its small GEMMs above two ranks: each peer's part takes longer
to arrive than the GEMM that consumes it (docs/performance.md, "TP efficiency"). The MLP's up
projection, whose backward runs just before, has a large weight-gradient GEMM that nothing reads
until the step ends. Its backward hands that GEMM here instead of running it (returning the gradient
tensor unfilled), and the output projection runs it after its own rows' GEMM, while the peers'
parts travel: the block's backward gets shorter by the waits it fills.

Holding is sound only where nothing reads the returned gradient before the GEMM fills it: inside
the capture of a CUDA graph of the blocks (GraphedBlocks), which differentiates them with
torch.autograd.grad and returns every gradient after its backward, and with no per-parameter
hooks (sharded data parallelism reduces gradients as they come). GraphedBlocks turns it on for the
capture (`holding`) and runs what is left at the end of the backward (`run`); anywhere else a
layer computes its weight gradient at once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Sequence


class HeldWeightGrads:
    """The GEMMs one block's layers hold (`hold`) and run later (`run`), in the order held. A block
    makes one and hands it to the layer that holds (its MLP) and the one that runs them (its
    attention's output projection). `enabled`: whether holding is allowed now (`holding`)."""

    def __init__(self):
        self.enabled = False
        self.pending: List[Callable[[], None]] = []

    def hold(self, gemm: Callable[[], None]) -> bool:
        """Keep `gemm` for `run`, if holding is on; returns whether it was kept (else run it now)."""
        if self.enabled:
            self.pending.append(gemm)
        return self.enabled

    def run(self) -> None:
        """Run the held GEMMs, in the order held, on the current stream."""
        pending, self.pending = self.pending, []
        for gemm in pending:
            gemm()


@contextlib.contextmanager
def holding(held: Sequence[HeldWeightGrads]) -> Iterator[None]:
    """Holding on for `held` (GraphedBlocks' warm-up and capture); whatever is still held when the
    block ends is run then, inside the capture, so that no gradient stays unfilled."""
    for h in held:
        h.enabled = True
    try:
        yield
        for h in held:
            h.run()
    finally:
        for h in held:
            h.enabled, h.pending = False, []
