"""The zigzag layout of a sequence over a context-parallel (cp) group.

A sequence of `seq` tokens is cut into 2*cp equal chunks; cp rank r holds chunks r and 2*cp-1-r,
in that order (seq/cp tokens). Under causal attention the early chunks see few keys and the late
ones many; pairing chunk r with its mirror gives every rank the same amount of work
(Striped/zigzag load balancing, as in ring-flash-attention and Megatron-Core).

Positions stay global: rank r's tokens are at positions
    [r*c, (r+1)*c) ++ [(2cp-1-r)*c, (2cp-r)*c),    c = seq / (2*cp),
which is what rotary embeddings and learned positions must see.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def check_cp_sequence(seq: int, cp: int) -> None:
    """Raise ValueError naming the numbers unless a sequence of `seq` tokens can be split over cp ranks."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2*cp={2 * cp} (context parallelism "
                         f"cuts every sequence into 2*cp equal chunks)")


def zigzag_chunks(cp_rank: int, cp: int) -> Tuple[int, int]:
    """The two chunk indices (of 2*cp) that cp rank `cp_rank` holds, in its order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_positions(seq: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """int64 [seq/cp]: the global positions of this rank's tokens."""
    check_cp_sequence(seq, cp)
    chunk = seq // (2 * cp)
    first, second = zigzag_chunks(cp_rank, cp)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def zigzag_shard(x: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor `x` (sequence along `dim`), a new tensor."""
    check_cp_sequence(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = zigzag_chunks(cp_rank, cp)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's shard (shards[r] from cp rank r), in natural order."""
    cp = len(shards)
    chunks: List[torch.Tensor] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = zigzag_chunks(rank, cp)
        chunks[first], chunks[second] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def natural_order(cp: int) -> List[int]:
    """For ranks' shards concatenated in rank order (each cut in its 2 chunks: 2*cp chunks), the index
    of the chunk that holds natural chunk c, for c = 0 .. 2*cp-1."""
    where = [0] * (2 * cp)
    for rank in range(cp):
        first, second = zigzag_chunks(rank, cp)
        where[first], where[second] = 2 * rank, 2 * rank + 1
    return where
