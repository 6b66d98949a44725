"""How one tensor of a tp (+ FSDP) model appears in a checkpoint: as its *unsharded* tensor.

A tp-sharded tensor (a module's `tp_shard_specs`) is written as a DTensor on the tp mesh with
placement Shard(spec.dim) over the unpadded global shape: rank r contributes the real rows of
its block, padding dropped. Replicated tensors are plain tensors. Every dp replica offers the
same chunks and DCP's planner writes each once; DCP's load reads whatever chunks overlap the
loading rank's block, so any (dp, tp), including a different vocabulary padding, reshards.

Under FSDP a tensor is a DTensor sharded over dp; the checkpoint first gathers it over dp
(`full_tensor()`), so each rank briefly holds its whole tp-local tensor (1/tp of the model,
and of each optimizer moment) at save and at load. Loading writes back only the rank's dp
slice of that buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..parallel.sharding import ShardSpec, iter_sharded
from ..parallel.state import get_default_state

MODEL_PREFIX = "model."


def contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(list(shape)):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class MeshCache:
    """The tp DeviceMesh of each process group a model uses (the default state's mesh when it matches)."""

    def __init__(self):
        self._meshes: Dict[int, DeviceMesh] = {}

    def mesh_for(self, group: Optional[dist.ProcessGroup], device: torch.device) -> Optional[DeviceMesh]:
        if group is None or dist.get_world_size(group) == 1:
            return None  # tp = 1: the local tensor is the whole tensor
        if id(group) not in self._meshes:
            ps = get_default_state()
            if ps is not None and ps.tp_group is group:
                self._meshes[id(group)] = ps.tp_mesh
            else:
                self._meshes[id(group)] = DeviceMesh.from_group(group, device.type)
        return self._meshes[id(group)]


def dp_gathered(t: torch.Tensor) -> torch.Tensor:
    """This tp rank's whole local tensor: an FSDP DTensor is all-gathered over dp (collective)."""
    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


def local_shape(t: torch.Tensor) -> torch.Size:
    """Shape of `dp_gathered(t)` without gathering (an FSDP DTensor's global shape is the tp-local one)."""
    return t.shape


def own_dp_piece(tp_local: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The part of a tp-local tensor that this rank holds under `like`'s dp placements (torch.chunk layout)."""
    coord = like.device_mesh.get_coordinate()
    piece = tp_local
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            dim, n = placement.dim, like.device_mesh.size(mesh_dim)
            start, end = ShardSpec(dim, piece.shape[dim]).local_range(coord[mesh_dim], n)
            piece = piece.narrow(dim, start, end - start)
    return piece


@dataclass
class TensorSlot:
    """One checkpoint entry: `key` in the checkpoint, `target` the live tensor (plain or FSDP DTensor)."""

    key: str
    target: torch.Tensor
    spec: Optional[ShardSpec] = None
    mesh: Optional[DeviceMesh] = None

    @property
    def global_shape(self) -> torch.Size:
        """The unsharded shape written to the checkpoint."""
        shape = list(local_shape(self.target))
        if self.mesh is not None:
            shape[self.spec.dim] = self.spec.full_size
        return torch.Size(shape)

    def as_global(self, tp_local: torch.Tensor) -> torch.Tensor:
        """`tp_local` (this rank's padded tp block) as a tensor of `global_shape` (DTensor under tp)."""
        if self.mesh is None:
            return tp_local
        start, end = self.spec.local_range(self.mesh.get_local_rank(), self.mesh.size())
        piece = tp_local.narrow(self.spec.dim, 0, end - start)
        return DTensor.from_local(piece, self.mesh, [Shard(self.spec.dim)], run_check=False,
                                  shape=self.global_shape, stride=contiguous_stride(self.global_shape))

    def for_save(self) -> torch.Tensor:
        return self.as_global(dp_gathered(self.target))

    def load_buffer(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A zeroed tp-local buffer for DCP to load into (padding rows stay zero)."""
        local = self.target.to_local() if isinstance(self.target, DTensor) else self.target
        return torch.zeros(local_shape(self.target), dtype=dtype or self.target.dtype, device=local.device)

    def dp_local(self, tp_local: torch.Tensor) -> torch.Tensor:
        """What this rank stores of `tp_local`: its dp slice under FSDP, else all of it."""
        if isinstance(self.target, DTensor):
            return own_dp_piece(tp_local, self.target)
        return tp_local

    def write_back(self, tp_local: torch.Tensor) -> None:
        """Copy a loaded tp-local buffer into the live tensor (its own dp slice under FSDP)."""
        piece = self.dp_local(tp_local)
        dest = self.target.to_local() if isinstance(self.target, DTensor) else self.target
        if dest.shape != piece.shape:
            raise RuntimeError(f"{self.key}: internal layout error, dp slice {tuple(piece.shape)} != "
                               f"local tensor {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(piece)


def model_slots(model: nn.Module, meshes: MeshCache) -> List[TensorSlot]:
    """A slot per state-dict entry of `model` (parameters and persistent buffers), in state-dict order."""
    sharded = {key: (spec, group) for key, spec, group in iter_sharded(model)}
    slots = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        spec, group = sharded.get(key, (None, None))
        device = tensor.device
        mesh = meshes.mesh_for(group, device) if spec is not None else None
        slots.append(TensorSlot(MODEL_PREFIX + key, tensor, spec if mesh is not None else None, mesh))
    return slots
