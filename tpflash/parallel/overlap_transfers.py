"""The transfers the overlapped sequence-parallel GEMMs (tpflash.parallel.overlap_gemms) wait on, one
rank's part at a time: through the copy engines (tpflash.parallel.peer_collectives) where they reach
the group (`copy_engines_reach`), else the group's own collectives with nothing overlapped
(`GroupAllGather`, `GroupReduceScatter`: what the CPU tests run), behind one interface:

  all_gather(x, group)          order(), piece(r) once rank r's rows are here, whole(), finish()
  reduce_scatter(group, shape)  send(r, part), then finish(own) / finish_matmul(a, w) / finish_parts(own)

and where, inside a CUDA graph capture, a producer may write the rows a transfer takes so that it
copies nothing (`kept_input_part`, `row_grad_part`). Process group: the tp group passed in.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import comm, peer_collectives


def copy_engines_reach(x: torch.Tensor, group) -> bool:
    """Whether x's collectives over group can go through the copy engines: CUDA, every rank on its own
    GPU of one host with peer access (peer_collectives.reachable), TPFLASH_COMM_BACKEND not "nccl"."""
    return peer_collectives.comm_backend() != "nccl" and peer_collectives.reachable(x, group)


def linear_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in for input x here: the autocast dtype when autocast is on
    (autocast leaves float64 alone), else x's."""
    dev = x.device.type
    if (dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and x.is_floating_point()
            and x.dtype != torch.float64):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class GroupAllGather:
    """PeerAllGather's interface over the group's own all-gather (no overlap)."""

    def __init__(self, x: torch.Tensor, group):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.x, self.out = x, comm.all_gather(x, 0, group)

    def order(self) -> List[int]:
        return [(self.rank + step) % self.world for step in range(self.world)]

    def piece(self, r: int) -> torch.Tensor:
        return self.out.chunk(self.world)[r]

    def whole(self) -> torch.Tensor:
        return self.out

    def finish(self) -> torch.Tensor:
        return self.out


class GroupReduceScatter:
    """PeerReduceScatter's interface over the group's own reduce-scatter (no overlap)."""

    def __init__(self, group, shape, dtype: torch.dtype, device: torch.device):
        self.group, self.rank = group, dist.get_rank(group)
        self.parts = torch.empty((dist.get_world_size(group),) + tuple(shape), dtype=dtype, device=device)

    def send(self, r: int, part: torch.Tensor, row: int = 0) -> None:
        self.parts[r][row:row + part.shape[0]].copy_(part)

    def finish(self, own: torch.Tensor) -> torch.Tensor:
        self.parts[self.rank].copy_(own)
        return comm.reduce_scatter(self.parts, 0, self.group)[0]

    def finish_matmul(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.finish(a @ w)

    def finish_parts(self, own: torch.Tensor) -> List[torch.Tensor]:
        return [self.finish(own)]


def all_gather(x: torch.Tensor, group, keep: bool = True, whole: bool = False,
               owner: Optional[torch.Tensor] = None):
    """The all-gather of x over group, each rank's part usable as it arrives; keep=False: `finish`
    need not return the gathered tensor (the copy engines then copy nothing out); whole: `whole()`
    may give every part as one tensor (or None: then by `piece`). keep with `owner` (the layer's first
    weight), in the work a CUDA graph captures: the parts arrive in a buffer of the owner's own
    (peer_collectives.kept_buffer), which `finish` returns as it is: nothing copied out, the capture
    guaranteeing the one backward per forward that keeps it valid."""
    if copy_engines_reach(x, group):
        kept = _kept_buffer(x.shape, x.dtype, x.device, group, owner) if keep and owner is not None else None
        pushes = peer_collectives.side_stream(x.device)
        return peer_collectives.PeerAllGather(x, group, pushes, keep=keep, by_piece=True,
                                              whole=whole, kept=kept)
    return GroupAllGather(x, group)


def _kept_buffer(shape, dtype: torch.dtype, device: torch.device, group, owner: torch.Tensor):
    """The buffer of owner's own that a kept all-gather of a [shape] dtype input over group (copy engines
    reaching it) lands in, in the work a CUDA graph captures (peer_collectives.kept_buffer); else None."""
    if not peer_collectives.capturing_for_graphs():
        return None
    nbytes = dist.get_world_size(group) * math.prod(shape) * dtype.itemsize
    return peer_collectives.kept_buffer(owner, group, device, nbytes)


def kept_input_part(like: torch.Tensor, group, owner: torch.Tensor) -> Optional[torch.Tensor]:
    """Where this rank's rows of a kept all-gather (overlap_gemms' column layer keeping its input, owner
    its first weight) lie in the owner's buffer, as a [like.shape] tensor of the dtype the layer computes
    in for input `like`: a producer that writes the layer's input there spares the gather its copy.
    None where the gather keeps nothing in such a buffer (outside a graph capture, or the copy
    engines not reaching the group)."""
    if not (peer_collectives.capturing_for_graphs() and copy_engines_reach(like, group)):
        return None
    dtype = linear_compute_dtype(like)
    kept = _kept_buffer(like.shape, dtype, like.device, group, owner)
    return None if kept is None else peer_collectives.kept_part(kept, group, like.shape, dtype)


def row_grad_part(group, shape, dtype: torch.dtype, device: torch.device,
                  kept: bool = False) -> Optional[torch.Tensor]:
    """Where the next row layer's backward on group (overlap_gemms' row layer, or the serial gather of
    the work a graph captures) all-gathers a grad_y [shape] of dtype and finds this rank's rows without
    copying them: in the work a CUDA graph captures over copy engines that reach the group, this
    rank's slot of the buffer that gather takes, reserved for it (peer_collectives.reserve_gather_part),
    or, for a row layer that keeps its gathered grad_y for a held weight gradient (`kept`), this rank's
    part of the group's buffer for those (`held_grad_y_owner`); None elsewhere. For grad_y's producer,
    the norm after the layer (ParallelNorm.x_grad_into), whose backward must be followed on the group
    by that gather."""
    if not (peer_collectives.capturing_for_graphs() and device.type == "cuda"
            and copy_engines_reach(torch.empty(0, device=device), group)):
        return None
    if kept:
        buffer = _kept_buffer(shape, dtype, device, group, held_grad_y_owner(group))
        return peer_collectives.kept_part(buffer, group, shape, dtype)
    return peer_collectives.reserve_gather_part(group, shape, dtype, device)


_held_grad_y_owners: Dict[int, torch.Tensor] = {}  # id(group) -> held_grad_y_owner(group)


def held_grad_y_owner(group) -> torch.Tensor:
    """The owner (peer_collectives.kept_buffer) of the buffer on group where a row layer keeps its gathered
    grad_y for a weight gradient held for later in its block's backward (tpflash.parallel.held_work):
    one for all such layers of the group, as one block's held gradients run within its own backward,
    before the next block's row layer gathers into it (that gather's pushes start only after a later
    call's barrier, which every rank reaches after the GEMMs queued before it)."""
    key = id(group)
    if key not in _held_grad_y_owners:
        _held_grad_y_owners[key] = torch.empty(0)
    return _held_grad_y_owners[key]


def reduce_scatter(group, shape, like: torch.Tensor):
    """A reduce-scatter over group of parts [shape] shaped and typed like `like`, sent one rank's part at a
    time (`send`) and finished with this rank's own (`finish`, `finish_matmul`, `finish_parts`)."""
    if copy_engines_reach(like, group):
        pushes = peer_collectives.side_stream(like.device)
        return peer_collectives.PeerReduceScatter(group, shape, like.dtype, like.device, pushes)
    return GroupReduceScatter(group, shape, like.dtype, like.device)
