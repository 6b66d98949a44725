"""How one tensor of a tp (+ FSDP) model appears in a checkpoint: as blocks of its *unsharded* tensor.

In DCP's metadata every tensor has its unsharded (unpadded) shape, and each rank contributes
one rectangular `Chunk` of it: the real (non-padding) part of what it holds.

- tp: rank r holds block r of dim `spec.dim` (torch.chunk layout, zero-padded, sharding.py);
  its chunk starts at r * ceil(full / tp) and drops the padding.
- FSDP / HSDP: each tp-local tensor is further split over dp by FSDP2 (torch.chunk along dim
  0, per its DTensor placements); the chunk is the rank's dp block of its tp block, still a
  rectangle of the unsharded tensor. No gather over dp, no extra memory: the chunk is a view
  of the live tensor, DCP writes from it and loads straight into it.
- Replicas (dp without FSDP, tp-replicated tensors, HSDP replicas) offer identical chunks;
  DCP's planner writes each once.

Loading reads whatever saved chunks overlap the loading rank's chunk, so any (dp, tp, FSDP),
including a different vocabulary padding, reshards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from ..parallel.sharding import ShardSpec, dp_block, iter_sharded
from ..parallel.state import group_rank, group_size

MODEL_PREFIX = "model."


@dataclass
class Chunk:
    """`piece` (a tensor, often a view of a live one) is the block at `offsets` of a tensor of `shape`."""

    piece: torch.Tensor
    offsets: Tuple[int, ...]
    shape: torch.Size

    def size(self) -> torch.Size:
        return self.shape

    def chunk_list(self) -> List[ChunkStorageMetadata]:
        if self.piece.numel() == 0:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.piece.shape)]

    def write_items(self, fqn: str) -> List[WriteItem]:
        """DCP write items (none for an empty piece, unless the whole tensor is empty)."""
        if self.piece.numel() == 0 and math.prod(self.shape) != 0:
            return []
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.piece.shape)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(self.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(
                              self.piece), size=self.shape))]


@dataclass
class TensorSlot:
    """One checkpoint entry: `key`, the live tensor `target` (plain or FSDP DTensor) and its tp layout."""

    key: str
    target: torch.Tensor
    spec: Optional[ShardSpec] = None
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def global_shape(self) -> torch.Size:
        """The unsharded shape written to the checkpoint (the tp-local shape is the FSDP DTensor's shape)."""
        shape = list(self.target.shape)
        if self.spec is not None:
            shape[self.spec.dim] = self.spec.full_size
        return torch.Size(shape)

    def local_like(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A zeroed tensor shaped like what this rank stores of `target` (its dp block under FSDP)."""
        local = self.target.to_local() if isinstance(self.target, DTensor) else self.target
        return torch.zeros(local.shape, dtype=dtype or local.dtype, device=local.device)

    def chunk(self, local: Optional[torch.Tensor] = None, zero_padding: bool = False) -> Chunk:
        """The chunk of `local` (default: the live tensor's storage), laid out like `target`.

        `zero_padding` zeroes the rows past the unpadded size in place (for loads: they stay zero).
        """
        if local is None:
            local = self.target.to_local() if isinstance(self.target, DTensor) else self.target
        local = local.detach()
        offsets, sizes = dp_block(self.target)
        if list(local.shape) != sizes:
            raise RuntimeError(f"{self.key}: layout error, local tensor {tuple(local.shape)} != dp block {sizes}")
        if self.spec is not None:
            d = self.spec.dim
            start, end = self.spec.local_range(self.tp_rank, self.tp_size)
            real = max(0, min(sizes[d], (end - start) - offsets[d]))
            if real < sizes[d] and zero_padding:
                with torch.no_grad():
                    local.narrow(d, real, sizes[d] - real).zero_()
            local = local.narrow(d, 0, real)
            offsets[d] += start
        return Chunk(local, tuple(offsets), self.global_shape)


def model_slots(model: nn.Module) -> List[TensorSlot]:
    """A slot per state-dict entry of `model` (parameters and persistent buffers), in state-dict order."""
    sharded = {key: (spec, group) for key, spec, group in iter_sharded(model)}
    slots = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        spec, group = sharded.get(key, (None, None))
        tp = group_size(group) if spec is not None else 1
        slots.append(TensorSlot(MODEL_PREFIX + key, tensor, spec if tp > 1 else None, group_rank(group), tp))
    return slots
