"""Optimizer state sharded over the data-parallel ranks (ZeRO-1), parameters kept in place.

FSDP shards parameters too, and so hands the layers new tensors every forward: the CUDA-graphed
blocks (which replay on the addresses they were captured with) cannot run under it, and the eager
step is host-bound. Where the parameters and gradients fit on every rank, most of FSDP's memory
saving is the optimizer state (8 of the 16 bytes per fp32 parameter that DDP holds), and sharding
only that keeps the parameters plain tensors at fixed addresses:

- every parameter becomes a view into one flat buffer per dtype (its gradient a view into a
  second), laid out so that each dp rank's *owned* parameters, whole tensors assigned greedily by
  size, form one contiguous, equally sized segment (zero-padded);
- after the backward one in-place reduce-scatter leaves each rank its own segment of the summed
  gradients, which it divides by dp (the average DDP and FSDP take);
- the optimizer steps only the owned parameters (the others have no `.grad` during the step, so
  torch's optimizers skip them and hold no state for them), fused AdamW and the clip inside it
  included;
- one in-place all-gather writes every rank's updated segment into everyone's flat buffer, which
  *is* the parameters: the captured graphs replay on them unchanged.

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
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.nn as nn

from .comm import _issue_all_gather, _issue_reduce_scatter
from .state import ParallelState

# each parameter's view starts at a multiple of this many elements (256 bytes in fp32): vector loads
# in the kernels that read the views stay aligned
_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def assign_owners(sizes: Sequence[int], ranks: int) -> List[int]:
    """The owning rank of each tensor: largest first, each to the least loaded rank (ties: lowest
    rank), which keeps the ranks' segments within one tensor of each other. Depends on the sizes
    alone, so every rank computes the same assignment."""
    loads = [0] * ranks
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += _aligned(sizes[i])
    return owners


class _FlatBuffer:
    """The parameters of one dtype as views into `params` (and their gradients into `grads`):
    rank r's owned tensors in [r * segment, (r + 1) * segment), in model order."""

    def __init__(self, params: List[nn.Parameter], ranks: int, rank: int):
        owners = assign_owners([p.numel() for p in params], ranks)
        offsets, fill = [0] * len(params), [0] * ranks
        for i, p in enumerate(params):
            offsets[i], fill[owners[i]] = fill[owners[i]], fill[owners[i]] + _aligned(p.numel())
        self.segment = max(max(fill), _ALIGN)
        first = params[0]
        self.params = torch.zeros(self.segment * ranks, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.params)
        self.owned: List[nn.Parameter] = []
        self.grad_views: List[Tuple[nn.Parameter, torch.Tensor]] = []  # (parameter, its gradient view), not owned
        with torch.no_grad():
            for p, owner, offset in zip(params, owners, offsets):
                start = owner * self.segment + offset
                view = self.params[start:start + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the Parameter object stays (optimizer, graphs, names); its storage moves here
                p.grad = self.grads[start:start + p.numel()].view_as(p)
                if owner == rank:
                    self.owned.append(p)
                else:
                    self.grad_views.append((p, p.grad))
        self.rank = rank

    def segment_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.rank * self.segment:(self.rank + 1) * self.segment]


class ShardedOptimizerState:
    """ZeRO-1 over `ps.dp_cp_group` for `model` (see the module docstring).

    Construct it on every rank after the model's weights are final (loaded or initialised alike on
    every dp rank) and before its CUDA graphs are captured and its optimizer is built; the optimizer
    may be built over all parameters as usual (it steps and keeps state for the owned ones only).
    Per step: forward and backward of every micro-batch (gradients accumulate in the flat buffer),
    then `reduce_gradients()`, the norm over `owned_params`, `step(...)` (the optimizer step on the
    owned parameters, then the all-gather), and `zero_grad()` instead of the optimizer's.
    Collectives over the dp * cp group: `reduce_gradients` and `step`.
    """

    def __init__(self, model: nn.Module, ps: ParallelState):
        self.group = ps.dp_cp_group
        self.ranks, self.rank = ps.dp_cp_size, ps.dp_cp_rank
        by_dtype: Dict[Tuple[torch.dtype, torch.device], List[nn.Parameter]] = {}
        for p in model.parameters():
            if p.requires_grad:
                if type(p) is not nn.Parameter:
                    raise ValueError(f"fsdp=zero1 needs plain parameters, got {type(p).__name__} (is the model "
                                     "already sharded with FSDP?)")
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
        self.buffers = [_FlatBuffer(params, self.ranks, self.rank) for params in by_dtype.values()]
        self.owned_params: List[nn.Parameter] = [p for b in self.buffers for p in b.owned]
        owned = {id(p) for p in self.owned_params}
        self.owned_names = frozenset(n for n, p in model.named_parameters() if id(p) in owned)

    def bytes_per_rank(self) -> Dict[str, int]:
        """What this rank holds: the flat parameter and gradient buffers (padding included), and the
        optimizer state of its owned parameters for AdamW (two moments of the parameter's dtype)."""
        params = sum(b.params.numel() * b.params.element_size() for b in self.buffers)
        owned = sum(p.numel() * p.element_size() for p in self.owned_params)
        return {"params": params, "grads": params, "adam_state": 2 * owned}

    def reduce_gradients(self) -> None:
        """Average the accumulated gradients over the group into each rank's own segment (in place);
        the other segments are left holding this rank's partial sums, unused until zero_grad."""
        for b in self.buffers:
            own = b.segment_of(b.grads)
            if self.ranks > 1:
                _issue_reduce_scatter(own, b.grads, self.group).wait()  # in place: `own` lies inside the input
                own.div_(self.ranks)

    @contextlib.contextmanager
    def _owned_gradients_only(self) -> Iterator[None]:
        """The optimizer's view during its step: only owned parameters have a gradient."""
        for b in self.buffers:
            for p, _ in b.grad_views:
                p.grad = None
        try:
            yield
        finally:
            for b in self.buffers:
                for p, view in b.grad_views:
                    p.grad = view

    def step(self, optimizer_step) -> None:
        """Run `optimizer_step()` (e.g. tpflash.train.gradients.clipped_step bound to its arguments) on
        the owned parameters, then all-gather every rank's updated segment into every flat buffer."""
        with self._owned_gradients_only():
            optimizer_step()
        if self.ranks > 1:
            with torch.no_grad():
                for b in self.buffers:
                    _issue_all_gather(b.params, b.segment_of(b.params), self.group).wait()  # in place, too

    def zero_grad(self) -> None:
        """Zero every gradient (the views stay; never set them to None)."""
        for b in self.buffers:
            b.grads.zero_()


def bytes_per_param(dp: int, param_bytes: int = 4) -> float:
    """Memory per parameter a rank holds under ZeRO-1 with AdamW: weight, gradient, and 1/dp of two
    moments (fp32: 8 + 8 / dp, against DDP's 16)."""
    return 2 * param_bytes + 2 * param_bytes / dp
