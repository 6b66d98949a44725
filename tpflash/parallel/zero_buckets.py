"""The flat-buffer layout of fsdp=zero1 (tpflash.parallel.zero): buckets of parameters, each rank's
owned tensors in one equal segment (reduce-scatter and all-gather in place), and the tensors too large
to balance a bucket, each reduced to one owner and broadcast from it."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .comm import _issue_all_gather, _issue_reduce_scatter

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


class Bucket:
    """Parameters of one dtype laid out as `ranks` equal segments of a flat region: rank r's owned
    tensors, in model order, in [r * segment, (r + 1) * segment); zero padding after each. Reduced
    by one reduce-scatter and gathered by one all-gather, in place."""

    def __init__(self, params: List[nn.Parameter], ranks: int, rank: int):
        self.params, self.rank = params, rank
        self.owners = assign_owners([p.numel() for p in params], ranks)
        offsets, fill = [0] * len(params), [0] * ranks
        for i, p in enumerate(params):
            offsets[i], fill[self.owners[i]] = fill[self.owners[i]], fill[self.owners[i]] + _aligned(p.numel())
        self.segment = max(max(fill), _ALIGN)
        self.numel = self.segment * ranks
        self.starts = [owner * self.segment + offset for owner, offset in zip(self.owners, offsets)]

    @torch.no_grad()
    def bind(self, flat_params: torch.Tensor, flat_grads: torch.Tensor) -> None:
        """Move every parameter into its place in the flat buffers (the region given), its .grad too."""
        self.flat_params, self.flat_grads = flat_params, flat_grads
        self.owned: List[nn.Parameter] = []
        self.grad_views: List[Tuple[nn.Parameter, torch.Tensor]] = []  # (parameter, its gradient view), not owned
        for p, owner, start in zip(self.params, self.owners, self.starts):
            view = flat_params[start:start + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view  # the Parameter object stays (optimizer, graphs, names); its storage moves here
            p.grad = flat_grads[start:start + p.numel()].view_as(p)
            if owner == self.rank:
                self.owned.append(p)
            else:
                self.grad_views.append((p, p.grad))

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.rank * self.segment:(self.rank + 1) * self.segment]

    def reduce(self, group, ranks: int) -> None:
        """Sum the gradients over the group into this rank's segment and divide by `ranks` (the other
        segments keep this rank's partial sums, unused until zero_grad)."""
        own = self.own(self.flat_grads)
        _issue_reduce_scatter(own, self.flat_grads, group).wait()  # in place: `own` lies inside the input
        own.div_(ranks)

    def gather(self, group) -> None:
        """Every rank's segment into every rank's flat parameters."""
        _issue_all_gather(self.flat_params, self.own(self.flat_params), group).wait()


class OneOwnerBucket(Bucket):
    """One parameter reduced to its owner (ncclReduce) and broadcast from it: for a tensor that equal
    segments could not balance (it would pad every other rank's segment to its size)."""

    def __init__(self, p: nn.Parameter, owner: int, rank: int):
        self.params, self.rank, self.owners = [p], rank, [owner]
        self.numel, self.starts = _aligned(p.numel()), [0]

    def reduce(self, group, ranks: int) -> None:
        grad = self.flat_grads[:self.params[0].numel()]
        dist.reduce(grad, dst=dist.get_global_rank(group, self.owners[0]), group=group)
        if self.rank == self.owners[0]:
            grad.div_(ranks)

    def gather(self, group) -> None:
        dist.broadcast(self.flat_params[:self.params[0].numel()], src=dist.get_global_rank(group, self.owners[0]),
                       group=group)


def _padded(sizes: Sequence[int], ranks: int) -> int:
    """Elements of the equal-segment layout of tensors of `sizes` over `ranks` (padding included)."""
    fill = [0] * ranks
    for size, owner in zip(sizes, assign_owners(sizes, ranks)):
        fill[owner] += _aligned(size)
    return max(max(fill), _ALIGN) * ranks


# a tensor leaves its bucket only from this size on: below it the padding costs little, and reductions
# of small tensors to one owner are where NCCL picks other algorithms than for the buckets' collectives
ALONE_MIN_ELEMENTS = 1 << 20


def split_unbalanced(sizes: Sequence[int], ranks: int, waste: float = 0.25,
                     min_elements: int = ALONE_MIN_ELEMENTS) -> List[int]:
    """Indices of the tensors to take out of an equal-segment bucket, largest first, while its padding
    is more than `waste` of its size and the largest left has `min_elements` or more (a large tensor
    alone leaves too: it would take a segment of its size per rank)."""
    kept, out = list(range(len(sizes))), []
    while kept and ranks > 1:
        if _padded([sizes[i] for i in kept], ranks) <= (1 + waste) * sum(_aligned(sizes[i]) for i in kept):
            break
        largest = max(kept, key=lambda i: (sizes[i], -i))
        if sizes[largest] < min_elements:
            break
        out.append(largest)
        kept.remove(largest)
    return out
