"""Cross-entropy over vocabulary-sharded logits, without ever gathering the full vocabulary.

Each rank holds logits[..., r*Vl:(r+1)*Vl] (Vl = local vocab). Two all-reduces of [tokens]
-sized vectors replace the gather of [tokens, V]: a MAX for the stable shift, then one SUM
of (sum exp, target logit, sum of logits) stacked together.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..parallel.state import group_rank, group_size, resolve_tp_group

_REDUCTIONS = ("mean", "sum", "none")


def _local_columns(vocab_size: Optional[int], local: int, rank: int) -> int:
    """How many of this rank's columns are real vocabulary (the rest is padding)."""
    if vocab_size is None:
        return local
    return max(0, min(local, vocab_size - rank * local))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, z_loss, vocab_size):
        tp, rank = group_size(group), group_rank(group)
        local = logits.shape[-1]
        real_cols = _local_columns(vocab_size, local, rank)
        num_classes = vocab_size if vocab_size is not None else local * tp
        x = logits.reshape(-1, local).float()  # [N, Vl]
        if real_cols < local:
            x = x.clone()
            x[:, real_cols:] = float("-inf")
        t = target.reshape(-1)
        valid = t != ignore_index

        shift = x.max(dim=-1).values  # [N]
        if tp > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        x = x - shift[:, None]  # new tensor; logits are left alone
        t_local = t - rank * local
        mine = valid & (t_local >= 0) & (t_local < local)
        t_idx = t_local.masked_fill(~mine, 0)
        sums = torch.stack([
            x.exp().sum(-1),
            x.gather(1, t_idx[:, None]).squeeze(1).masked_fill(~mine, 0.0),
            x[:, :real_cols].sum(-1) if label_smoothing > 0 else torch.zeros_like(shift),
        ])  # [3, N]
        if tp > 1:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit, sum_logits = sums
        lse_shifted = sum_exp.log()
        loss = lse_shifted - target_logit
        if label_smoothing > 0:
            loss = (1 - label_smoothing) * loss + label_smoothing * (lse_shifted - sum_logits / num_classes)
        lse = lse_shifted + shift
        if z_loss > 0:
            loss = loss + z_loss * lse.square()
        loss = loss.masked_fill(~valid, 0.0)

        ctx.save_for_backward(logits, lse, t_idx, mine, valid)
        ctx.args = (label_smoothing, z_loss, real_cols, num_classes)
        return loss  # [N] fp32, 0 at ignored tokens

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, t_idx, mine, valid = ctx.saved_tensors
        label_smoothing, z_loss, real_cols, num_classes = ctx.args
        local = logits.shape[-1]
        x = logits.reshape(-1, local).float()
        grad = (x - lse[:, None]).exp_()  # softmax, [N, Vl]
        if real_cols < local:
            grad[:, real_cols:] = 0.0
        if z_loss > 0:
            grad.mul_(1 + 2 * z_loss * lse[:, None])
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, t_idx] -= (1 - label_smoothing) * mine.to(grad.dtype)
        if label_smoothing > 0:
            grad[:, :real_cols] -= label_smoothing / num_classes
        grad.mul_((grad_loss * valid)[:, None])
        return grad.to(logits.dtype).reshape(logits.shape), None, None, None, None, None, None


def _check_target(target: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    if target.device.type != "cpu" or target.numel() == 0:
        return  # on GPU the check would cost a device sync on every step
    bad = target[(target != ignore_index) & ((target < 0) | (target >= num_classes))]
    if bad.numel():
        raise ValueError(f"target {int(bad[0])} is outside [0, {num_classes}) and is not ignore_index={ignore_index}")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, process_group=None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                                 reduction: str = "mean", *, vocab_size: Optional[int] = None) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) computed from this rank's vocabulary shard.

    logits: [*, V/tp] (any float dtype; math in fp32), rank r holding columns [r*V/tp, (r+1)*V/tp).
    target: [*] int, global class ids; `ignore_index` tokens add nothing and are not counted.
    label_smoothing: PyTorch's definition. z_loss: adds z_loss * logsumexp(logits)^2 per token
    (for "mean": z_loss * mean over non-ignored tokens). vocab_size: the real vocabulary when
    the sharded logits carry padding columns at the end (they are treated as -inf).
    Returns a scalar for "mean"/"sum", [*] for "none"; the same value on every tp rank.
    Process group: `process_group`, else the default tp group, else none (tp=1).
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {_REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if z_loss < 0:
        raise ValueError(f"z_loss={z_loss} must be >= 0")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match target shape {tuple(target.shape)} "
                         "(expected logits [*, V/tp] and target [*])")
    group = resolve_tp_group(process_group)
    tp = group_size(group)
    if vocab_size is not None and not 0 < vocab_size <= logits.shape[-1] * tp:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {logits.shape[-1] * tp}] "
                         f"({tp} shards of {logits.shape[-1]} columns)")
    _check_target(target, vocab_size or logits.shape[-1] * tp, ignore_index)
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index, label_smoothing, z_loss, vocab_size)
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum()
