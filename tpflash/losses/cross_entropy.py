"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full vocabulary.

Each rank holds logits[..., r*Vl:(r+1)*Vl] (Vl = local vocab). One pass over the shard
(tpflash.kernels.cross_entropy: Triton on CUDA, PyTorch on CPU) gives per row the local max,
sum of exp relative to it, the target logit and the sum of logits; two all-reduces of
[tokens]-sized vectors then replace the gather of [tokens, V]: a MAX, and one SUM of the
rescaled sums stacked together. The gradient is one more pass, in place when allowed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..kernels.cross_entropy import cross_entropy_grad, cross_entropy_stats
from ..parallel.state import group_rank, group_size, resolve_tp_group

_REDUCTIONS = ("mean", "sum", "none")


def _local_columns(vocab_size: Optional[int], local: int, rank: int) -> int:
    """How many of this rank's columns are real vocabulary (the rest is padding)."""
    if vocab_size is None:
        return local
    return max(0, min(local, vocab_size - rank * local))


class ShardLoss:
    """Per-row loss of a [n, Vl] logits shard, and the pieces its gradient needs.

    loss [n] fp32 (0 at ignored rows), lse [n] (global log-sum-exp), target_col [n] (local
    column of the target or -1), valid [n] bool. Collectives: 2 all-reduces over `group`.
    """

    def __init__(self, x, target, group, ignore_index, label_smoothing, z_loss, vocab_size):
        tp, rank = group_size(group), group_rank(group)
        local = x.shape[-1]
        self.real_cols = _local_columns(vocab_size, local, rank)
        self.num_classes = vocab_size if vocab_size is not None else local * tp
        self.label_smoothing, self.z_loss = label_smoothing, z_loss
        self.valid = target != ignore_index
        t_local = target - rank * local
        mine = self.valid & (t_local >= 0) & (t_local < local)
        self.target_col = torch.where(mine, t_local, -1).to(torch.int32)
        row_max, sum_exp, picked, total = cross_entropy_stats(x, self.target_col, self.real_cols, label_smoothing > 0)
        global_max = row_max.clone()
        if tp > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        shift = global_max.masked_fill(global_max == float("-inf"), 0.0)
        sums = torch.stack([sum_exp * (row_max - shift).exp(), picked, total])  # [3, n]
        if tp > 1:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit, sum_logits = sums
        self.lse = sum_exp.log() + shift
        loss = self.lse - target_logit
        if label_smoothing > 0:
            loss = (1 - label_smoothing) * loss + label_smoothing * (self.lse - sum_logits / self.num_classes)
        if z_loss > 0:
            loss = loss + z_loss * self.lse.square()
        self.loss = loss.masked_fill(~self.valid, 0.0)

    def logits_grad(self, x, row_scale, out=None):
        """d (sum_i row_scale_i * loss_i) / d x; row_scale [n] is zeroed at ignored rows here."""
        return cross_entropy_grad(x, self.lse, self.target_col, row_scale * self.valid, self.real_cols,
                                  self.label_smoothing, self.num_classes, self.z_loss, out=out)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, z_loss, vocab_size, inplace_backward):
        x = logits.reshape(-1, logits.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        shard = ShardLoss(x, target.reshape(-1), group, ignore_index, label_smoothing, z_loss, vocab_size)
        shard.loss_shape = logits.shape
        # in place only when x is logits' own storage (a reshape that copied would make it pointless)
        ctx.inplace = inplace_backward and x.data_ptr() == logits.data_ptr() and x.is_contiguous()
        ctx.save_for_backward(x)
        ctx.shard = shard
        return shard.loss  # [N] fp32, 0 at ignored tokens

    @staticmethod
    def backward(ctx, grad_loss):
        (x,) = ctx.saved_tensors
        shard = ctx.shard
        grad = shard.logits_grad(x, grad_loss.float(), out=x if ctx.inplace else None)
        return grad.reshape(shard.loss_shape), None, None, None, None, None, None, None


def _check_target(target: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    if target.device.type != "cpu" or target.numel() == 0:
        return  # on GPU the check would cost a device sync on every step
    bad = target[(target != ignore_index) & ((target < 0) | (target >= num_classes))]
    if bad.numel():
        raise ValueError(f"target {int(bad[0])} is outside [0, {num_classes}) and is not ignore_index={ignore_index}")


def check_loss_args(reduction: str, label_smoothing: float, z_loss: float) -> None:
    """Raise ValueError for a reduction/label_smoothing/z_loss outside its domain."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss} must be >= 0")


def check_vocab(vocab_size: Optional[int], local: int, tp: int, target: torch.Tensor, ignore_index: int) -> None:
    """Raise ValueError for a vocab_size that does not fit tp shards of `local` columns, or a bad target."""
    if vocab_size is not None and not 0 < vocab_size <= local * tp:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {local * tp}] ({tp} shards of {local} columns)")
    _check_target(target, vocab_size or local * tp, ignore_index)


def reduce_loss(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-token losses [N] -> the requested reduction ("mean" divides by the non-ignored count)."""
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    return total if reduction == "sum" else total / (target != ignore_index).sum()


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, process_group=None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                                 reduction: str = "mean", *, vocab_size: Optional[int] = None,
                                 inplace_backward: bool = False) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) computed from this rank's vocabulary shard.

    logits: [*, V/tp] (any float dtype; math in fp32), rank r holding columns [r*V/tp, (r+1)*V/tp).
    target: [*] int, global class ids; `ignore_index` tokens add nothing and are not counted.
    label_smoothing: PyTorch's definition. z_loss: adds z_loss * logsumexp(logits)^2 per token
    (for "mean": z_loss * mean over non-ignored tokens). vocab_size: the real vocabulary when
    the sharded logits carry padding columns at the end (they are treated as -inf).
    inplace_backward: the backward writes the logits' gradient into the logits tensor itself
    (saves a [tokens, V/tp] buffer; only when nothing else needs the logits after the loss).
    Returns a scalar for "mean"/"sum", [*] for "none"; the same value on every tp rank.
    Process group: `process_group`, else the default tp group, else none (tp=1).
    """
    check_loss_args(reduction, label_smoothing, z_loss)
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match target shape {tuple(target.shape)} "
                         "(expected logits [*, V/tp] and target [*])")
    group = resolve_tp_group(process_group)
    check_vocab(vocab_size, logits.shape[-1], group_size(group), target, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, label_smoothing, z_loss, vocab_size,
                                            inplace_backward)
    return reduce_loss(loss, target, ignore_index, reduction)
