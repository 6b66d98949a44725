"""The vocabulary-parallel embedding's sequence-parallel exchange through peers' memory (CUDA, NVLink).

Under sequence parallelism rank q keeps the embeddings of its s/tp positions, and each token's row
lies in one rank's vocabulary shard. The group's way (VocabParallelEmbedding on NCCL) looks every
token up on every rank, zeroes the rows the rank does not own and reduce-scatters the [s, b, dim]
partial sums: (tp-1)/tp of an fp32 activation leaves each rank, nearly all of it zeros, and the
backward all-gathers the gradient and masks it again. Here only the rows a rank owns move:

  forward   rank r writes the table rows of the tokens it owns straight into the workspace buffer of
            the rank that holds their positions (`write_owned_rows`: a Triton kernel storing into
            the peer's mapped memory); a barrier; each rank copies its buffer out as the output
  backward  each rank puts its [s/tp * b, dim] output gradient in its buffer; a barrier; each rank
            reads the rows of the tokens it owns from every rank's buffer into a dense [s * b, dim]
            gradient, zeros elsewhere (`read_owned_rows`); a barrier; torch's embedding backward
            over it gives the table's gradient (`table_grad`)

Each row crosses NVLink once: about 1/tp of the activation per rank instead of (tp-1)/tp, and no sums
(docs/performance.md, "TP efficiency"). The results are the group path's bits: every output row is
one table row, and the table's gradient sums the same rows in the same order. Buffers and barriers:
tpflash.parallel.peer_workspace (the group's workspace, two buffers taking turns, two barriers a
call). Process group: the tp group passed in; the ids are the same on every rank of it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..kernels.owned_rows import ZERO_INVALID, ZERO_NONE, ZERO_UNOWNED, copy_owned_rows
from . import peer_collectives
from .peer_workspace import _slot_bytes, _take_turn, _workspace


def reaches(weight: torch.Tensor, group) -> bool:
    """Whether the exchange can serve weight's group: CUDA, every rank mapping every other's memory
    (peer_collectives.reachable, a collective on the first call per group), and TPFLASH_COMM_BACKEND
    not "nccl"."""
    return peer_collectives.comm_backend() != "nccl" and peer_collectives.reachable(weight, group)


def write_owned_rows(ids: torch.Tensor, shard: torch.Tensor, vocab_start: int, vocab_padded: int, rank: int,
                     buffers: Sequence[torch.Tensor]) -> None:
    """This rank's part of the forward: for every rank q, the rows of `shard` (this rank's table rows,
    ids [vocab_start, vocab_start + rows)) that q's positions use, written into buffers[q] [n/world, dim]
    at those positions. ids [n]: every position's token, in rank order (q holds chunk q). In this
    rank's own buffer, positions whose id no rank owns (outside [0, vocab_padded)) get zeros."""
    world, hi = len(buffers), vocab_start + shard.shape[0]
    chunks = ids.chunk(world)
    for step in range(1, world + 1):  # the peers first, each rank starting at its next one; its own last
        q = (rank + step) % world
        copy_owned_rows(chunks[q], shard, buffers[q], vocab_start, hi, lookup=True,
                        zero=ZERO_INVALID if q == rank else ZERO_NONE, valid_hi=vocab_padded)


def read_owned_rows(ids: torch.Tensor, buffers: Sequence[torch.Tensor], vocab_start: int, rows: int,
                    rank: int) -> torch.Tensor:
    """This rank's part of the backward: the output gradient rows of the tokens this rank owns, read from
    buffers[r] ([n/world, dim], rank r's gradient), as one [n, dim] tensor with zeros at the other
    positions. ids [n] as in write_owned_rows."""
    world = len(buffers)
    dense = buffers[0].new_empty((ids.shape[0], buffers[0].shape[1]))
    id_chunks, dense_chunks = ids.chunk(world), dense.chunk(world)
    for step in range(world):  # this rank's own buffer first, then each peer's, the next one first
        r = (rank + step) % world
        copy_owned_rows(id_chunks[r], buffers[r], dense_chunks[r], vocab_start, vocab_start + rows,
                        lookup=False, zero=ZERO_UNOWNED)
    return dense


def table_grad(dense: torch.Tensor, ids: torch.Tensor, vocab_start: int, rows: int,
               padding_row: Optional[int]) -> torch.Tensor:
    """The gradient of this rank's table shard [rows, dim] from read_owned_rows' dense gradient [n, dim]:
    torch's embedding backward, with the tokens this rank does not own and those of padding_row (a
    local row, or None) sent to an extra row that is then dropped. rows + 1 must fit in int32."""
    local = ids - vocab_start
    dropped = (local < 0) | (local >= rows)
    if padding_row is not None:
        dropped |= local == padding_row
    local = local.masked_fill(dropped, rows).to(torch.int32)  # int32: half the radix sort's passes of int64
    return torch.ops.aten.embedding_dense_backward(dense, local, rows + 1, rows, False)[:rows]


class _PeerVocabLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, vocab_start: int, vocab_padded: int,
                padding_row: Optional[int], group) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        shape = (ids.shape[0] // world, weight.shape[1])
        views = _Buffers(group, weight.device, shape, weight.dtype)
        write_owned_rows(ids, weight, vocab_start, vocab_padded, rank, views.peers)
        views.ws.barrier()  # every rank's rows are in every buffer
        out = views.peers[rank].clone()
        views.release()
        ctx.save_for_backward(ids)
        ctx.args = (vocab_start, weight.shape[0], padding_row, group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        vocab_start, rows, padding_row, group = ctx.args
        rank = dist.get_rank(group)
        views = _Buffers(group, grad.device, tuple(grad.shape), grad.dtype)
        views.peers[rank].copy_(grad)
        views.ws.barrier()  # every rank's gradient is in its buffer
        dense = read_owned_rows(ids, views.peers, vocab_start, rows, rank)
        views.release()
        return table_grad(dense, ids, vocab_start, rows, padding_row), None, None, None, None, None


class _Buffers:
    """One call's buffer on every rank of the group (this call's turn of the group's workspace), as
    [n/world, dim] views: `peers[r]` is rank r's (mapped memory for r != this rank)."""

    def __init__(self, group, device: torch.device, shape, dtype: torch.dtype):
        slot = _slot_bytes(shape, dtype)
        self.ws = _workspace(group, device, 2 * slot)
        buffer, self.in_epoch = _take_turn(self.ws)
        self.peers: List[torch.Tensor] = [self.ws.view(r, buffer * slot, shape, dtype)
                                          for r in range(dist.get_world_size(group))]

    def release(self) -> None:
        """The closing barrier (outside a graph epoch): every rank is done with the buffers."""
        if not self.in_epoch:
            self.ws.barrier()


def vocab_lookup(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_padded: int,
                 padding_row: Optional[int], group) -> torch.Tensor:
    """The rows of the full table that ids [s, *] name, this rank's [s/world, *, dim] along dim 0, from
    this rank's shard weight [rows, dim] (ids [vocab_start, vocab_start + rows)) and the peers':
    VocabParallelEmbedding's sequence-parallel forward through peers' memory (module docstring).
    Differentiable in weight; padding_row (a local row, or None) gets no gradient. s divisible by the
    group's size; every rank of group calls it with the same ids."""
    world = dist.get_world_size(group)
    out = _PeerVocabLookup.apply(weight, ids.reshape(-1).contiguous(), vocab_start, vocab_padded, padding_row, group)
    return out.view((ids.shape[0] // world,) + tuple(ids.shape[1:]) + (weight.shape[1],))
