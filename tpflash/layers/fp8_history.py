"""Amax histories for fp8 delayed scaling (`fp8="delayed"`): each cast is scaled by the amaxes its
tensor had in the steps before, so it reads the tensor once, with no amax pass in front of it.

Every fp8 GEMM of a delayed-scaling model has three histories, for its input x, its (stacked) weight
W and its output gradient dY, each HISTORY_LENGTH fp32 entries: entry 0 collects this step's amax
(each cast max-es the amax of what it casts into it, in the same pass: kernels.fp8.cast_delayed),
entries 1.. hold the previous steps' times HEADROOM, and their maximum scales this step's casts (an
all-zero history scales by 1). All of a model's histories are the rows of one table, [3 * GEMMs, HISTORY_LENGTH], so
that a step moves them on with a few small kernels, and one all-reduce over tp (the maximum: ranks
that gather each other's fp8 activations under sequence parallelism must scale them alike).

Steps, as the model sees them (tpflash.models.gpt calls `advance` at the start of every training
forward, once per micro-batch):
- the first training forward after the table is made runs with current scaling (each scale from its
  tensor's own amax, as the tensorwise recipe), recording the amaxes: a new model, or one resumed from a
  checkpoint (which holds no fp8 state), starts from true amaxes rather than from a scale of 1;
- from the second on, every cast is delayed: its scale comes from the previous HISTORY_LENGTH - 1
  forwards' amaxes times HEADROOM, so a tensor whose amax grew past that overflows the fp8 range and
  is clamped to it (saturated), as in Transformer Engine's delayed scaling (HEADROOM 2 is its margin 1);
- a non-finite amax (a NaN or inf in a tensor) is recorded as 0 when the step moves on: that step's own
  output shows it, and the scales of the following steps come from the other entries;
- a delayed step whose amax exceeded its scale's is counted (`AmaxHistory.saturations`: the trainer
  logs the counts as fp8_saturated_x/w/dy), so that a run shows how often its casts clamp.
CUDA graphs capture the delayed casts (`capturing`), and replay only once the table is primed; the
capture's passes over a sample input leave the table as they found it.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

HISTORY_LENGTH = 16  # this step's entry and 15 previous ones (torchao's delayed scaling kept 16)
# Entries 1.. hold the recorded amaxes times HEADROOM, so that a tensor may grow by that factor before
# its cast clamps; it costs one binade at the bottom of the fp8 range. Without it (Transformer Engine's
# margin 0) a 1B model clamped 43% of its weight casts (weights grow as they train), 9% of the
# activations' and 7% of the gradients', and trained measurably worse (docs/fp8.md, "Delayed scaling").
HEADROOM = 2.0
KINDS = ("x", "w", "dy")  # a GEMM's three rows, in table order


class GemmHistory(NamedTuple):
    """One fp8 GEMM's amax histories, rows of its model's AmaxHistory table: x, w and dy, each
    [HISTORY_LENGTH] fp32 ([0] this step's amax, [1:] the previous steps')."""
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    table: "AmaxHistory"

    @property
    def delayed(self) -> bool:
        """Whether the casts take their scales from the history now (else from their own tensors)."""
        return self.table.primed or self.table.capturing


class AmaxHistory:
    """The amax histories of `layers`' fp8 GEMMs, one GemmHistory each, set as the layer's
    `fp8_history` attribute (the layers that own a delayed-scaling GEMM: ColumnParallelLinear and
    RowParallelLinear, the first projection of a stacked one; Block.fp8_gemm_layers lists a block's).
    process_group: the tp group whose ranks share scales (None: none)."""

    def __init__(self, layers: Sequence[nn.Module], device, process_group: Optional[dist.ProcessGroup] = None):
        if not layers:
            raise ValueError("AmaxHistory needs at least one layer with a delayed-scaling fp8 GEMM")
        self.table = torch.zeros(3 * len(layers), HISTORY_LENGTH, device=device, dtype=torch.float32)
        self.process_group = process_group
        self.forwards = 0  # training forwards begun (advance calls)
        self.saturated = torch.zeros(3 * len(layers), device=device, dtype=torch.int32)  # per row, since read
        self.capturing = False
        for i, layer in enumerate(layers):
            layer.fp8_history = GemmHistory(*self.table[3 * i:3 * i + 3], self)

    @property
    def primed(self) -> bool:
        """Whether a training forward has recorded every GEMM's amaxes: from the second one on."""
        return self.forwards > 1

    def advance(self) -> None:
        """Start a training forward: this step's amaxes (non-finite ones as 0; the maximum over tp),
        times HEADROOM, become the newest previous entry, the oldest is dropped, and entry 0 starts
        again from 0. A row whose amax exceeded the one its delayed casts were scaled by is counted."""
        current = torch.nan_to_num(self.table[:, 0], nan=0.0, posinf=0.0, neginf=0.0)
        if self.process_group is not None and dist.get_world_size(self.process_group) > 1:
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=self.process_group)
        if self.primed:  # the forward that ends here cast with entries 1..: did its tensors outgrow them?
            self.saturated += current > self.table[:, 1:].amax(dim=1)
        self.forwards += 1
        moved = self.table.roll(1, dims=1)
        moved[:, 1] = current * HEADROOM
        moved[:, 0] = 0
        self.table.copy_(moved)

    def saturations(self) -> Dict[str, int]:
        """How many delayed casts (tensor and step) had values clamped to the fp8 range since the last
        call, by operand: {"x": .., "w": .., "dy": ..}; then starts counting again (one host sync)."""
        counts = self.saturated.view(-1, 3).sum(dim=0).tolist()
        self.saturated.zero_()
        return dict(zip(KINDS, counts))

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """CUDA graph capture: the casts run delayed (what the replays must do), and the table holds
        afterwards what it held before (the capture's passes run on a sample input)."""
        saved, self.capturing = self.table.clone(), True
        try:
            yield
        finally:
            self.capturing = False
            self.table.copy_(saved)
