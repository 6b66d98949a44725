"""What a model does around context-parallel attention: give each cp rank its tokens, combine the loss.

The cp ranks of one group share every sequence of their batch. Each is given the whole batch (like
the tp ranks), keeps its seq/cp tokens in the zigzag layout (tpflash.parallel.zigzag), runs every
layer on them (attention over the whole sequence through tpflash.parallel.context_attention), and
the loss is summed over the group.

Gradient convention: the loss every cp rank returns is the whole sequence's, and its backward scales
by cp, so each rank's parameter gradients are cp times its own tokens' share. Averaging them over the
cp ranks, which FSDP and DDP over the dp x cp ranks (ParallelState.dp_cp_mesh) do anyway, then
gives exactly the whole sequence's gradient: no separate sum over cp is needed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .zigzag import check_cp_sequence, zigzag_positions, zigzag_shard


def check_cp_batch(seq: int, cp: int, tp: int, sequence_parallel: bool) -> None:
    """Raise ValueError naming the numbers unless sequences of `seq` tokens split over cp (and, with
    sequence parallelism, each rank's seq/cp tokens over tp)."""
    check_cp_sequence(seq, cp)
    if sequence_parallel and (seq // cp) % tp:
        raise ValueError(f"sequence length {seq} gives each of cp={cp} ranks {seq // cp} tokens, which is not "
                         f"divisible by tp={tp} (sequence parallelism)")


def shard_batch(idx: torch.Tensor, targets: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                cp_group: dist.ProcessGroup) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """This cp rank's (idx, targets, position_ids), each [batch, seq/cp], from the whole batch's
    [batch, seq] tensors; position_ids default to the tokens' global positions."""
    rank, cp = cp_group.rank(), cp_group.size()
    batch, seq = idx.shape
    if position_ids is None:
        positions = zigzag_positions(seq, rank, cp, device=idx.device).expand(batch, -1)
    else:
        positions = zigzag_shard(position_ids, 1, rank, cp)
    local_targets = None if targets is None else zigzag_shard(targets, 1, rank, cp)
    return zigzag_shard(idx, 1, rank, cp), local_targets, positions


class _SumOverCP(torch.autograd.Function):
    """forward: the sum over the cp group; backward: the gradient times cp (module docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.cp = group.size()
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp, None


def combine_loss(local_loss: torch.Tensor, counted: Optional[torch.Tensor], cp_group: dist.ProcessGroup) -> torch.Tensor:
    """The whole batch's loss from this rank's sum of token losses: the sum over cp, or with `counted`
    (this rank's number of counted tokens) the mean over every counted token of the group."""
    total = _SumOverCP.apply(local_loss, cp_group)
    if counted is None:
        return total
    counted = counted.to(total.dtype)
    dist.all_reduce(counted, group=cp_group)
    return total / counted
