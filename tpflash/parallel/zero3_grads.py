"""Where fsdp=zero3 (tpflash.parallel.zero3) keeps a step's sharded block gradients, and what each
master's .grad views.

The main pieces' gradients (everything but the tp-partial norm weights) are not held between steps,
as FSDP2's are not: a block's [shard] gradient is allocated when the backward first reduces the
block, where the activations it has already freed make room. An eager backward allocates it from
the caching allocator and the next micro-batches add to it. A captured backward allocates it from
the CUDA graphs' memory pool, and every replay writes it afresh; the next forward replay writes its
activations over that memory, so before it runs (a second micro-batch) the pool's gradients are
added to the step's own (`before_forward_replay`). The tp-partial pieces' gradients are small and
held, zeroed at `new_step`. After every backward each master's .grad views its gradient.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .zero3_layout import Piece

View = Callable[[torch.Tensor, Piece], torch.Tensor]  # a block's [shard] buffer, a piece -> its DTensor


class StepGradients:
    """The blocks' sharded gradients of the current step (module docstring). `shard_numel`: elements of a
    block's shard per kind ("main", "partial"); `view(flat, piece)`: the piece's DTensor in a block's
    [shard] buffer (ShardedBlocks._sharded)."""

    def __init__(self, n_blocks: int, shard_numel: Dict[str, int], dtype: torch.dtype, device, view: View):
        self.view = view
        self.new_buffer = functools.partial(torch.empty, shard_numel["main"], dtype=dtype, device=device)
        self.partial = torch.zeros(n_blocks, shard_numel["partial"], dtype=dtype, device=device)  # [block, shard]
        self.main_masters: List[List[Tuple[nn.Parameter, Piece]]] = [[] for _ in range(n_blocks)]
        self.partial_views: List[Tuple[nn.Parameter, torch.Tensor]] = []  # (master, its held gradient)
        self.block: List[Optional[torch.Tensor]] = [None] * n_blocks  # this step's sums ([shard] each)
        self.pool: Optional[List[Optional[torch.Tensor]]] = None  # a captured backward's, in the graphs' pool
        self.pool_views: Optional[List[Tuple[nn.Parameter, torch.Tensor]]] = None
        self.pool_live = False  # a replayed backward's gradients are in the pool, not yet added to `block`
        self.in_graph_backward = False  # inside GraphSync.gradient_hooks: a captured (or stand-in) backward

    def add_master(self, i: int, kind: str, master: nn.Parameter, piece: Piece) -> None:
        """Register block i's master of `piece`, whose .grad this object sets."""
        if kind == "main":
            self.main_masters[i].append((master, piece))
        else:
            self.partial_views.append((master, self.view(self.partial[i], piece)))

    def target(self, kind: str, i: int) -> Tuple[torch.Tensor, bool]:
        """(block i's sharded gradient of `kind`, whether a reduction adds to it rather than writes it),
        allocated on the current stream where it is the block's first this step (or capture)."""
        if kind == "partial":
            return self.partial[i], True
        if self.in_graph_backward:
            if self.pool is None:
                self.pool = [None] * len(self.block)
            if self.pool[i] is None:
                self.pool[i] = self.new_buffer()
            return self.pool[i], False
        if self.block[i] is None:
            self.block[i] = self.new_buffer()
            return self.block[i], False
        return self.block[i], True

    def after_eager_backward(self) -> None:
        self._take_pool()  # a replayed backward earlier in the step: its gradients join in
        self._point()

    def backward_replayed(self) -> None:
        self.pool_live = True
        if any(g is not None for g in self.block):  # accumulating: into this step's sums at once
            self._take_pool()
        self._point()

    def before_forward_replay(self) -> None:
        if self.pool_live:
            self._take_pool()
            self._point()

    def new_step(self) -> None:
        """After the optimizer step and zero_grad: the main pieces' gradients are freed (nothing keeps
        them alive, a warm-up's either), the partial pieces' zeroed."""
        self.block = [None] * len(self.block)
        self.pool_live = False
        for main in self.main_masters:
            for master, _ in main:
                master.grad = None
        self.partial.zero_()
        for master, grad in self.partial_views:
            master.grad = grad

    def _take_pool(self) -> None:
        """Add the gradients a replayed backward left in the pool to this step's sums."""
        if not self.pool_live:
            return
        for i, pooled in enumerate(self.pool):
            if self.block[i] is None:
                self.block[i] = pooled.clone()
            else:
                self.block[i].add_(pooled)
        self.pool_live = False

    def _point(self) -> None:
        """Every main master's .grad: its view of this step's gradient (of the pool's, while one replayed
        backward alone wrote them; None before any backward)."""
        if self.pool_live:
            if self.pool_views is None:
                self.pool_views = [(master, self.view(self.pool[i], piece))
                                   for i, main in enumerate(self.main_masters) for master, piece in main]
            for master, view in self.pool_views:
                master.grad = view
            return
        for grad, main in zip(self.block, self.main_masters):
            for master, piece in main:
                master.grad = None if grad is None else self.view(grad, piece)
