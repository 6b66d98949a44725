"""How a tensor-parallel parameter relates to its unsharded tensor, and full (unsharded) state dicts.

A parallel layer declares, in `self.tp_shard_specs`, which of its parameters are split over its
`self.process_group` and along which dim. Rank r holds the contiguous block
[r*chunk, (r+1)*chunk) of the unsharded tensor padded (with zeros) to chunk*tp along that dim,
where chunk = ceil(full_size / tp). This is exactly torch.chunk / DTensor Shard(dim) layout of
the *unpadded* tensor, which is why checkpoints can reshard across tp (see tpflash.checkpoint).
Parameters without a spec are replicated over tp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .state import group_rank, group_size


@dataclass(frozen=True)
class ShardSpec:
    """`dim` is split over the tp group; `full_size` is its unpadded length in the full tensor."""

    dim: int
    full_size: int

    def chunk(self, tp: int) -> int:
        return math.ceil(self.full_size / tp)

    def local_range(self, rank: int, tp: int) -> Tuple[int, int]:
        """[start, end) of the real (unpadded) indices held by `rank`; may be empty at the end."""
        c = self.chunk(tp)
        return min(rank * c, self.full_size), min((rank + 1) * c, self.full_size)

    def shard(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's padded shard of the unsharded tensor `full`."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"expected size {self.full_size} along dim {self.dim}, got shape {tuple(full.shape)}")
        start, end = self.local_range(rank, tp)
        piece = full.narrow(self.dim, start, end - start)
        missing = self.chunk(tp) - (end - start)
        if missing:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = missing
            piece = torch.cat([piece, full.new_zeros(pad_shape)], dim=self.dim)
        return piece.contiguous()

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The unsharded tensor from the concatenation of all padded shards."""
        return gathered.narrow(self.dim, 0, self.full_size)


def take_shards(module: nn.Module, tensors: Mapping[str, Optional[torch.Tensor]]) -> None:
    """Make `module`'s parameters this rank's shards of the given unsharded tensors ({name: tensor or
    None}; the layout from module.tp_shard_specs over module.process_group), keeping their values,
    dtype, device and requires_grad: no initialisation, no communication. A replicated tensor, or
    any at tp=1, is kept as the same nn.Parameter; a shard is a copy, so that the full tensor is
    not kept alive by a view of it."""
    group = getattr(module, "process_group", None)
    tp, rank = group_size(group), group_rank(group)
    for name, full in tensors.items():
        if full is None:
            continue
        spec = module.tp_shard_specs.get(name)
        if spec is None or tp == 1:
            param = full if isinstance(full, nn.Parameter) else nn.Parameter(full.detach(), full.requires_grad)
        else:
            with torch.no_grad():
                piece = spec.shard(full.detach(), rank, tp)
                if piece.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                    piece = piece.clone()
            param = nn.Parameter(piece, requires_grad=full.requires_grad)
        setattr(module, name, param)


def dp_block(t: torch.Tensor) -> Tuple[List[int], List[int]]:
    """(offsets, sizes) per dim of this rank's block of `t` within its tp-local tensor: an FSDP2
    DTensor is split with torch.chunk along its Shard dims (HSDP's Replicate dims add nothing);
    a plain tensor is the whole block."""
    sizes, offsets = list(t.shape), [0] * t.dim()
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import Shard
        coord = t.device_mesh.get_coordinate()
        for mesh_dim, placement in enumerate(t.placements):
            if isinstance(placement, Shard):
                d = placement.dim
                start, end = ShardSpec(d, sizes[d]).local_range(coord[mesh_dim], t.device_mesh.size(mesh_dim))
                offsets[d] += start
                sizes[d] = end - start
    return offsets, sizes


def iter_sharded(module: nn.Module) -> Iterator[Tuple[str, ShardSpec, Optional[dist.ProcessGroup]]]:
    """(state-dict key, spec, group) of every tp-sharded tensor in `module`."""
    for prefix, sub in module.named_modules():
        specs: Dict[str, ShardSpec] = getattr(sub, "tp_shard_specs", {})
        for name, spec in specs.items():
            key = f"{prefix}.{name}" if prefix else name
            yield key, spec, getattr(sub, "process_group", None)


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of this tp rank's values (FSDP2 DTensor shards are gathered over dp)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


def full_state_dict(module: nn.Module, device: Optional[torch.device] = None) -> Dict[str, torch.Tensor]:
    """The unsharded state dict: same keys and shapes as the equivalent non-parallel module.

    Collective over every tp group (and dp group under FSDP) the module uses: call on all ranks.
    Every rank receives the full tensors (on `device`, default: where they are).
    """
    sharded = {key: (spec, group) for key, spec, group in iter_sharded(module)}
    out = {}
    for key, value in module.state_dict().items():
        value = _local_tensor(value)
        if key in sharded:
            spec, group = sharded[key]
            value = spec.unpad(comm.all_gather(value, spec.dim, group))
        out[key] = value if device is None else value.to(device)
    return out


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Load unsharded tensors (as `full_state_dict` returns them) into a parallel module.

    Each rank takes its own shard; no communication except under FSDP. Shape mismatches raise
    ValueError naming the key, before anything is copied.
    """
    sharded = {key: (spec, group) for key, spec, group in iter_sharded(module)}
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    pieces = {}
    for key, target in own.items():
        if key not in state_dict:
            continue
        full = state_dict[key]
        if key in sharded:
            spec, group = sharded[key]
            expected = list(target.shape)
            expected[spec.dim] = spec.full_size
            if list(full.shape) != expected:
                raise ValueError(f"{key}: checkpoint shape {tuple(full.shape)} != model shape {tuple(expected)}")
            full = spec.shard(full, group_rank(group), group_size(group))
        elif tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(full.shape)} != model shape {tuple(target.shape)}")
        pieces[key] = full
    with torch.no_grad():
        params = dict(module.named_parameters(remove_duplicate=False))
        params.update(dict(module.named_buffers(remove_duplicate=False)))
        for key, piece in pieces.items():
            target = params[key]
            if hasattr(target, "device_mesh"):  # FSDP2 DTensor: take this dp rank's slice
                from torch.distributed.tensor import distribute_tensor
                piece = distribute_tensor(piece.to(target.device), target.device_mesh, target.placements)
            target.copy_(piece.to(device=target.device, dtype=target.dtype))


def copy_values(target: nn.Module, source: nn.Module) -> None:
    """source's parameters and buffers into target's, name by name: source holds what an unsharded-over-dp
    target would (e.g. a module freshly built with the same arguments: this tp rank's part), target's
    tensors may be DTensor shards over dp (FSDP2, fsdp=zero3), of which each rank takes its own rows
    locally: every dp rank must hold the same source values. No communication."""
    own = dict(target.named_parameters(remove_duplicate=False))
    own.update(target.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, value in [*source.named_parameters(remove_duplicate=False), *source.named_buffers()]:
            t = own[name]
            if tuple(t.shape) != tuple(value.shape):
                raise ValueError(f"{name}: source shape {tuple(value.shape)} != target shape {tuple(t.shape)}")
            if hasattr(t, "device_mesh"):  # this rank's rows, as the DTensor lays them out
                from torch.distributed.tensor import distribute_tensor
                value = distribute_tensor(value.to(t.device), t.device_mesh, t.placements, src_data_rank=None)
            t.copy_(value)
