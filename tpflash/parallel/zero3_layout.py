"""Where fsdp=zero3 (tpflash.parallel.zero3) keeps each block parameter: its rows split over the dp
ranks as torch.chunk splits them (FSDP2's Shard(0)), this rank's rows at `shard_start` of a block's
flat shard, and the gathered parameter (every rank's rows, the last ones padded) at `full_start` of
a compute slot. Every block has the same layout."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn

Named = List[Tuple[str, nn.Parameter]]


@dataclass
class Piece:
    """One block parameter: its path in the block, shape, rows per rank, and places in the buffers."""
    path: str  # e.g. "attn.q_proj.weight"
    shape: torch.Size
    chunk: int  # rows per rank: ceil(rows / ranks)
    shard_start: int  # in a block's flat shard: chunk * inner elements from here
    full_start: int  # in a compute or reduction slot, to full_end: ranks * chunk * inner elements (padded rows)
    full_end: int

    @property
    def inner(self) -> int:
        return self.shape[1:].numel()

    @property
    def shard_numel(self) -> int:
        return self.chunk * self.inner


def layout(named: Named, ranks: int) -> Tuple[List[Piece], int, int]:
    """(the pieces of `named` in order, elements of a block's shard, elements of a slot)."""
    pieces, shard, full = [], 0, 0
    for path, p in named:
        if p.dim() == 0:
            raise ValueError(f"fsdp=zero3 shards parameters by rows: {path} is a scalar")
        chunk = -(-p.shape[0] // ranks)
        inner = p.shape[1:].numel()
        pieces.append(Piece(path, p.shape, chunk, shard, full, full + ranks * chunk * inner))
        shard += chunk * inner
        full += ranks * chunk * inner
    return pieces, shard, full


def stacking_order(block: nn.Module, named: Named) -> Named:
    """The block's parameters with each group its layers multiply stacked (q/k/v, up/gate:
    `weight_cast_groups`) side by side, so that a gathered group is one view of the slot rather than
    a copy (weight_casts.stacked_cast); the rest in module order."""
    path_of = {id(p): (n, p) for n, p in named}
    groups = getattr(block, "weight_cast_groups", list)()
    first = [path_of[id(t)] for g in groups if len(g) > 1 for t in g if t is not None and id(t) in path_of]
    taken = {n for n, _ in first}
    return first + [(n, p) for n, p in named if n not in taken]


def block_parameters(blocks: List[nn.Module]) -> Tuple[List[Named], List[bool]]:
    """Each block's trainable parameters in stacking order, and which of them are tp-partial (summed
    over tp at the end of the stack's backward: `tp_partial_grad_parameters`). ValueError unless
    every block has the same names, shapes and one dtype, in plain parameters."""
    if not blocks:
        raise ValueError("fsdp=zero3 shards a model's transformer blocks: this model has no `blocks`")
    named = [[(n, p) for n, p in b.named_parameters() if p.requires_grad] for b in blocks]
    template = [(n, tuple(p.shape), p.dtype) for n, p in named[0]]
    for i, params in enumerate(named):
        if [(n, tuple(p.shape), p.dtype) for n, p in params] != template:
            raise ValueError(f"fsdp=zero3 needs blocks of one shape: block {i}'s parameters differ from block 0's")
        if any(type(p) is not nn.Parameter for _, p in params):
            raise ValueError("fsdp=zero3 needs plain parameters (is the model already sharded with FSDP?)")
    dtypes = sorted({str(dtype) for _, _, dtype in template})
    if len(dtypes) != 1:
        raise ValueError(f"fsdp=zero3 needs the block parameters in one dtype, got {dtypes}")
    named = [stacking_order(b, params) for b, params in zip(blocks, named)]
    partial = {id(p) for p in getattr(blocks[0], "tp_partial_grad_parameters", list)()}
    return named, [id(p) in partial for _, p in named[0]]


def module_and_name(block: nn.Module, path: str) -> Tuple[nn.Module, str]:
    """The submodule of `block` holding the parameter at `path`, and its attribute name."""
    module_path, _, name = path.rpartition(".")
    return (block.get_submodule(module_path) if module_path else block), name
