"""DCP planners that understand `Chunk` entries (a rank's block of an unsharded tensor, layout.py).

Planners are DCP's documented extension point. These extend the default ones only where a
value is a Chunk: its write/read items come from the chunk's offsets, and its data is the
chunk's piece. Everything else (plain tensors, pickled objects) goes through DCP's own
helpers, so the files and metadata are a standard DCP checkpoint.
"""
from __future__ import annotations

from typing import List

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem, SavePlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .layout import Chunk


class ChunkSavePlanner(DefaultSavePlanner):
    """Save a flat state dict whose values are Chunks, tensors (replicated) or picklable objects."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, value in self.state_dict.items():
            if isinstance(value, Chunk):
                items += value.write_items(fqn)
            else:
                items += create_default_local_save_plan({fqn: value}, self.is_coordinator).items
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.piece if isinstance(value, Chunk) else super().lookup_object(index)


def _bytes_read(fqn: str) -> ReadItem:
    zero = torch.Size((0,))
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn), dest_offsets=zero,
                    storage_index=MetadataIndex(fqn), storage_offsets=zero, lengths=zero)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Load into a flat state dict of Chunks (filled in place), plain tensors (whole) and None (pickled objects).

    Every key must exist in the checkpoint (callers check first, with clearer messages).
    """

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.state_dict = self.original_state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items: List[ReadItem] = []
        for fqn, value in self.state_dict.items():
            saved = self.metadata.state_dict_metadata[fqn]
            if isinstance(saved, BytesStorageMetadata):
                items.append(_bytes_read(fqn))
                continue
            chunk = value if isinstance(value, Chunk) else Chunk(value, (0,) * value.dim(), value.shape)
            items += create_read_items_for_chunk_list(fqn, saved, chunk.chunk_list())
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.piece if isinstance(value, Chunk) else super().lookup_tensor(index)
