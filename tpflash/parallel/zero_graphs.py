"""fsdp=zero1 inside CUDA-graphed blocks: the dp communication overlapped with the blocks' compute.

Without this, zero1 reduce-scatters every gradient after the graphed backward returns and
all-gathers every parameter after the optimizer step, with nothing left to compute meanwhile.
`GraphSync` moves the blocks' buckets (tpflash.parallel.zero) into the graphs' shadow:

- backward: while the backward is captured, a hook on each bucketed block parameter copies its
  gradient into the flat buffer; when a bucket's last gradient is there, its in-place
  reduce-scatter (and the divide by dp) is captured on a side stream, so the replay reduces bucket
  i while the blocks before it compute their gradients. The graph returns no gradient for those
  parameters (they are in place already). The head's buckets (final norm, output layer), whose
  gradients the eager head computed before the replay, are reduced first, at the graph's start.
  Everything else (embeddings, the blocks' tp-partial-gradient parameters) is reduced after the
  backward as before.
- forward: the optimizer step's all-gather of each block bucket runs on a side stream and records
  an external CUDA event; the captured forward waits on that event just before the bucket's first
  block, so the next forward starts as soon as the embedding's bucket (gathered first, in order on
  the main stream) is there and gathers the later blocks' weights while the earlier ones compute.
  The head's buckets are gathered last, and the forward graph's end waits for them.
  Anything else that reads the parameters between a step and the next training forward calls
  `ShardedOptimizerState.wait_for_parameters()` first (the trainer does before evaluating,
  sampling and saving; the eager path of GPT.forward does by itself).

The gradients are copied, not accumulated, inside the graph: one backward per optimizer step
(grad_accum=1, where the overlap matters; with accumulation the reduction's cost is shared by the
micro-batches anyway and the trainer captures without it). A second backward before zero_grad
raises. On CPU (the graphs' eager stand-in) the same hooks run every replay and the collectives run
inline: the plumbing is tested over gloo, the streams and events on GPUs.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Sequence

import torch
import torch.nn as nn


class GraphSync:
    """The dp reduction and gathering of `zero`'s (a ShardedOptimizerState's) block buckets, for the
    graphed `blocks`: the same blocks, in order, that `zero` bucketed. Made by
    `zero.sync_in_graphs(blocks)`, handed to the capture (GPT.capture_cuda_graphs(..., dp_sync=)),
    then to `zero.use_graph_sync`. Process group: zero's dp * cp group."""

    def __init__(self, zero, blocks: Sequence[nn.Module]):
        self.zero = zero
        self.cuda = any(b.flat_params.is_cuda for b in zero.buckets)
        bucket_of: Dict[int, object] = {id(p): b for b in zero.block_buckets for p in b.params}
        self.first_use: List[List[object]] = []  # per block: the buckets whose first parameter it holds
        seen = set()
        for block in blocks:
            mine = []
            for p in block.parameters():
                b = bucket_of.get(id(p))
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    mine.append(b)
            self.first_use.append(mine)
        if len(seen) != len(zero.block_buckets):
            raise ValueError("GraphSync: the graphed blocks are not the blocks the ShardedOptimizerState bucketed")
        self.hooked = frozenset(bucket_of)  # ids of the parameters whose gradients the captured backward takes
        if self.cuda:
            self.stream = torch.cuda.Stream()  # the all-gathers after the optimizer step
            self.side = torch.cuda.Stream()  # the captured reduce-scatters
            self.gathered = {id(b): torch.cuda.Event(external=True) for b in zero.block_buckets}
            self.head_gathered = torch.cuda.Event(external=True)
        self.reduced = False  # this step's backward replay reduced the block buckets

    # ---- capture time --------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Before the capture: each captured bucket's reduction and gathering once, eagerly. NCCL sets up
        what an operation needs on its first use (a reduce to one owner, say), which a capture does not
        allow. Safe on the state before training: the gradients are reduced and zeroed again, the
        parameters gathered from their owners, who hold the same values."""
        for b in self.zero.head_buckets + self.zero.block_buckets:
            self.zero.reduce_bucket(b)
            self.zero.gather_bucket(b)
            b.flat_grads.zero_()

    def before_block(self, index: int) -> None:
        """Captured before block `index`: wait for the all-gather of the buckets it is first to use."""
        if self.cuda:
            for b in self.first_use[index]:
                torch.cuda.current_stream().wait_event(self.gathered[id(b)])

    def after_blocks(self) -> None:
        """Captured after the last block: wait for the head's all-gathers (the eager head runs next)."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.head_gathered)

    @contextlib.contextmanager
    def gradient_hooks(self) -> Iterator[None]:
        """Around the captured backward: the head's buckets reduced at its start (their gradients are
        complete when it replays), each block bucket once its gradients are in place."""
        for b in self.zero.head_buckets:
            self._reduce(b)
        pending = {id(b): len(b.params) for b in self.zero.block_buckets}
        handles = []

        def on_grad(bucket, p, grad):
            p.grad.copy_(grad)
            pending[id(bucket)] -= 1
            if pending[id(bucket)] == 0:
                self._reduce(bucket)
            return grad

        for b in self.zero.block_buckets:
            for p in b.params:
                handles.append(p.register_hook(lambda g, b=b, p=p: on_grad(b, p, g)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        missing = sum(pending.values())
        if missing:  # every rank captures the same blocks: all raise here alike, before any replay
            raise RuntimeError(f"{missing} block parameter(s) got no gradient in the captured backward: fsdp=zero1 "
                               "inside CUDA graphs needs every block parameter used")
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.side)

    def _reduce(self, bucket) -> None:
        if not self.cuda:
            self.zero.reduce_bucket(bucket)
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            self.zero.reduce_bucket(bucket)

    # ---- replay time ---------------------------------------------------------------------------
    def backward_replayed(self) -> None:
        if self.reduced:
            raise RuntimeError("a second backward through the graphed blocks before zero_grad: fsdp=zero1 with the "
                               "reduction inside the CUDA graphs takes one backward per optimizer step (grad_accum=1)")
        self.reduced = True

    def reduced_buckets(self) -> Sequence[object]:
        return self.zero.block_buckets + self.zero.head_buckets if self.reduced else ()

    def new_step(self) -> None:
        self.reduced = False

    def gather(self) -> None:
        """After the optimizer step: the rest's buckets in order (the embedding needs its weights first),
        then the blocks' on the side stream, each recording the event its first block waits for, then
        the head's."""
        zero = self.zero
        for b in zero.rest_buckets:
            zero.gather_bucket(b)
        if not self.cuda:
            for b in zero.block_buckets + zero.head_buckets:
                zero.gather_bucket(b)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for b in zero.block_buckets:
                zero.gather_bucket(b)
                self.gathered[id(b)].record(self.stream)
            for b in zero.head_buckets:
                zero.gather_bucket(b)
            self.head_gathered.record(self.stream)

    def wait_all(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
