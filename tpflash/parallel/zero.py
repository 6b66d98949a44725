"""Optimizer state sharded over the data-parallel ranks (ZeRO-1), parameters kept in place.

FSDP shards parameters too, and so hands the layers new tensors every forward: the CUDA-graphed
blocks (which replay on the addresses they were captured with) cannot run under it, and the eager
step is host-bound. Where the parameters and gradients fit on every rank, most of FSDP's memory
saving is the optimizer state (8 of the 16 bytes per fp32 parameter that DDP holds), and sharding
only that keeps the parameters plain tensors at fixed addresses:

- every parameter becomes a view into one flat buffer per dtype (its gradient a view into a
  second), cut into buckets (the embeddings and whatever else is outside the transformer blocks,
  the blocks' own, a block or a few per bucket, then the head: final norm and output layer);
  within a bucket each dp rank's *owned* parameters, whole tensors assigned greedily by size, form
  one contiguous, equally sized segment (zero-padded). A tensor too large for that to balance (an
  embedding or output layer beside a few small tensors, at dp > 2) would pad every segment to its
  size: it leaves the bucket and is reduced to one owner and broadcast from it instead;
- after the backward an in-place reduce-scatter per bucket leaves each rank its own segment of the
  summed gradients, which it divides by dp (the average DDP and FSDP take);
- the optimizer steps only the owned parameters (the others have no `.grad` during the step, so
  torch's optimizers skip them and hold no state for them), fused AdamW and the clip inside it
  included;
- an in-place all-gather per bucket writes every rank's updated segment into everyone's flat
  buffer, which *is* the parameters: the captured graphs replay on them unchanged. Graphed blocks
  can carry their buckets' collectives inside the graphs, overlapped with their compute
  (tpflash.parallel.zero_graphs).

Communication per step equals DDP's all-reduce (a reduce-scatter plus an all-gather); memory per
rank is 4 bytes per parameter for the weights, 4 for the gradients and 8 / dp for AdamW's moments
(`bytes_per_param`). Whole tensors per owner (rather than a flat split of every tensor) keep each
optimizer state tensor shaped like its parameter, so checkpoints are the standard per-parameter
ones: each rank writes its owned parameters' state, and any layout (DDP, FSDP, another dp or tp)
reads it (`owned_names` tells the loader which state this rank keeps).

The group is `ps.dp_cp_group`: cp ranks hold the same parameters as dp peers (see fsdp.py). tp
parameters are plain local tensors, so each tp rank shards its own local tensors over its dp peers.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .state import ParallelState
from .zero_buckets import Bucket, OneOwnerBucket, split_unbalanced

def _bucket_groups(model: nn.Module, blocks: Sequence[nn.Module], head: Sequence[nn.Module], ranks: int
                   ) -> Tuple[List[nn.Parameter], List[List[nn.Parameter]], List[nn.Parameter]]:
    """(rest, block groups, head): the parameters that need a gradient, in buckets. `rest` is everything
    outside the blocks and the head, plus the blocks' tp-partial-gradient parameters (complete only at
    the end of the backward). The block groups follow in forward order, each of enough consecutive
    blocks to give every rank a tensor twice over (one block has too few tensors to balance many
    ranks). `head`: the parameters of the `head` modules (run after the blocks: their gradients are
    complete before the blocks' backward starts)."""
    for p in model.parameters():
        if p.requires_grad and type(p) is not nn.Parameter:
            raise ValueError(f"fsdp=zero1 needs plain parameters, got {type(p).__name__} (is the model already "
                             "sharded with FSDP?)")
    partial = {id(p) for b in blocks if hasattr(b, "tp_partial_grad_parameters") for p in b.tp_partial_grad_parameters()}
    seen = set(partial)  # a parameter shared by several blocks goes with the first
    per_block = []
    for b in blocks:
        per_block.append([p for p in b.parameters() if p.requires_grad and id(p) not in seen])
        seen.update(id(p) for p in per_block[-1])
    groups: List[List[nn.Parameter]] = []
    for params in per_block:
        if groups and len(groups[-1]) < 2 * ranks:
            groups[-1].extend(params)
        else:
            groups.append(list(params))
    head_params = []
    for m in head:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                head_params.append(p)
                seen.add(id(p))
    taken = {id(p) for g in groups for p in g} | {id(p) for p in head_params}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return rest, [g for g in groups if g], head_params


def _default_head(model: nn.Module, blocks: Sequence[nn.Module]) -> List[nn.Module]:
    """What runs after the blocks in tpflash's GPT: the final norm and the untied output layer."""
    if not blocks:
        return []
    return [m for m in (getattr(model, "final_norm", None), getattr(model, "lm_head", None)) if isinstance(m, nn.Module)]


class ShardedOptimizerState:
    """ZeRO-1 over `ps.dp_cp_group` for `model` (see the module docstring).

    Construct it on every rank after the model's weights are final (loaded or initialised alike on
    every dp rank) and before its CUDA graphs are captured and its optimizer is built; the optimizer
    may be built over all parameters as usual (it steps and keeps state for the owned ones only).
    Per step: forward and backward of every micro-batch (gradients accumulate in the flat buffer),
    then `reduce_gradients()`, the norm over `owned_params`, `step(...)` (the optimizer step on the
    owned parameters, then the all-gather), and `zero_grad()` instead of the optimizer's.
    `blocks` (default `model.blocks` where it has them): the transformer blocks, each bucket of
    which is reduced and gathered on its own, so that CUDA-graphed blocks can overlap that with
    their compute (tpflash.parallel.zero_graphs); `head` (default the model's `final_norm` and
    `lm_head`, where it has blocks): the modules run after them, bucketed apart (the graphs reduce
    them first in the backward and gather them last). Collectives over the dp * cp group:
    `reduce_gradients` and `step`.
    """

    def __init__(self, model: nn.Module, ps: ParallelState, blocks: Optional[Sequence[nn.Module]] = None,
                 head: Optional[Sequence[nn.Module]] = None):
        self.group = ps.dp_cp_group
        self.ranks, self.rank = ps.dp_cp_size, ps.dp_cp_rank
        self.blocks = list(getattr(model, "blocks", []) if blocks is None else blocks)
        head = _default_head(model, self.blocks) if head is None else list(head)
        rest, block_groups, head_params = _bucket_groups(model, self.blocks, head, self.ranks)
        self._alone_load = [0] * self.ranks  # elements of the one-owner tensors each rank owns so far
        self.rest_buckets = self._buckets(rest)  # the embeddings, whatever else is outside blocks and head
        self.block_buckets = [b for group in block_groups for b in self._buckets(group)]  # in forward order
        self.head_buckets = self._buckets(head_params)
        self.buckets: List[Bucket] = self.rest_buckets + self.block_buckets + self.head_buckets
        self.flat: Dict[Tuple[torch.dtype, torch.device], Tuple[torch.Tensor, torch.Tensor]] = {}
        for key in {(b.params[0].dtype, b.params[0].device) for b in self.buckets}:
            mine = [b for b in self.buckets if (b.params[0].dtype, b.params[0].device) == key]
            flat_params = torch.zeros(sum(b.numel for b in mine), dtype=key[0], device=key[1])
            flat_grads = torch.zeros_like(flat_params)
            start = 0
            for b in mine:
                b.bind(flat_params[start:start + b.numel], flat_grads[start:start + b.numel])
                start += b.numel
            self.flat[key] = (flat_params, flat_grads)
        self.owned_params: List[nn.Parameter] = [p for b in self.buckets for p in b.owned]
        owned = {id(p) for p in self.owned_params}
        self.owned_names = frozenset(n for n, p in model.named_parameters() if id(p) in owned)
        self.graph_sync = None  # a zero_graphs.GraphSync once graphed blocks reduce and gather their buckets

    def _buckets(self, params: List[nn.Parameter]) -> List[Bucket]:
        """One bucket per dtype, less the tensors it could not balance (each then a OneOwnerBucket of its own,
        owned by the rank with the fewest such elements so far)."""
        by_dtype: Dict[Tuple[torch.dtype, torch.device], List[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        made: List[Bucket] = []
        for group in by_dtype.values():
            alone = split_unbalanced([p.numel() for p in group], self.ranks)
            for i in alone:
                owner = min(range(self.ranks), key=lambda r: (self._alone_load[r], r))
                self._alone_load[owner] += group[i].numel()
                made.append(OneOwnerBucket(group[i], owner, self.rank))
            shared = [p for i, p in enumerate(group) if i not in alone]
            if shared:
                made.append(Bucket(shared, self.ranks, self.rank))
        return made

    def sync_in_graphs(self, blocks: Sequence[nn.Module]):
        """A tpflash.parallel.zero_graphs.GraphSync for `blocks` (this object's own blocks, graphed as one
        stack: GPT.capture_cuda_graphs(..., dp_sync=)): hand it to the capture, then to `use_graph_sync`."""
        from .zero_graphs import GraphSync
        return GraphSync(self, blocks)

    def use_graph_sync(self, sync) -> None:
        """From now on the graphs captured with `sync` reduce and gather the blocks' buckets."""
        self.graph_sync = sync

    def bytes_per_rank(self) -> Dict[str, int]:
        """What this rank holds: the flat parameter and gradient buffers (padding included), and the
        optimizer state of its owned parameters for AdamW (two moments of the parameter's dtype)."""
        params = sum(f.numel() * f.element_size() for f, _ in self.flat.values())
        owned = sum(p.numel() * p.element_size() for p in self.owned_params)
        return {"params": params, "grads": params, "adam_state": 2 * owned}

    def reduce_bucket(self, b: Bucket) -> None:
        """Average bucket b's gradients over the group into its owners' places, in place (elsewhere
        this rank's partial sums stay, unused until zero_grad)."""
        if self.ranks > 1:
            b.reduce(self.group, self.ranks)

    def gather_bucket(self, b: Bucket) -> None:
        """The owners' updated parameters of bucket b into every rank's flat parameters, in place."""
        if self.ranks > 1:
            b.gather(self.group)

    def reduce_gradients(self) -> None:
        """Average the accumulated gradients over the group, bucket by bucket (those the graphed blocks'
        backward reduced already are left as they are)."""
        reduced = self.graph_sync.reduced_buckets() if self.graph_sync is not None else ()
        for b in self.buckets:
            if not any(b is r for r in reduced):
                self.reduce_bucket(b)

    @contextlib.contextmanager
    def _owned_gradients_only(self) -> Iterator[None]:
        """The optimizer's view during its step: only owned parameters have a gradient."""
        for b in self.buckets:
            for p, _ in b.grad_views:
                p.grad = None
        try:
            yield
        finally:
            for b in self.buckets:
                for p, view in b.grad_views:
                    p.grad = view

    def step(self, optimizer_step) -> None:
        """Run `optimizer_step()` (e.g. tpflash.train.gradients.clipped_step bound to its arguments) on
        the owned parameters, then all-gather every rank's updated segments into every flat buffer
        (with graphed blocks that overlap it: the blocks' buckets on a side stream, which the next
        forward replay waits for block by block; `wait_for_parameters` before any other use)."""
        with self._owned_gradients_only():
            optimizer_step()
        with torch.no_grad():
            if self.graph_sync is not None:
                self.graph_sync.gather()
            else:
                for b in self.buckets:
                    self.gather_bucket(b)

    def wait_for_parameters(self) -> None:
        """Make the current stream wait until every parameter holds its updated value: call before using
        the parameters outside a training forward (evaluation, checkpoints) when graphed blocks gather
        their buckets in the background. A no-op otherwise."""
        if self.graph_sync is not None:
            self.graph_sync.wait_all()

    def zero_grad(self) -> None:
        """Zero every gradient (the views stay; never set them to None)."""
        for _, grads in self.flat.values():
            grads.zero_()
        if self.graph_sync is not None:
            self.graph_sync.new_step()


def bytes_per_param(dp: int, param_bytes: int = 4) -> float:
    """Memory per parameter a rank holds under ZeRO-1 with AdamW: weight, gradient, and 1/dp of two
    moments (fp32: 8 + 8 / dp, against DDP's 16)."""
    return 2 * param_bytes + 2 * param_bytes / dp
