"""The (vocab-parallel) cross-entropy's row statistics and gradient: Triton on CUDA, the reference elsewhere.

`cross_entropy_stats` returns, per row of a logits shard, the max, the sum of exp(x - max), the
logit at the target column and the sum of the logits (for label smoothing); the loss code combines
these across tp ranks. `cross_entropy_grad` writes d loss / d logits, optionally into the logits
buffer itself. Both skip the padding columns at and past `real_cols`. The Triton kernels live in
cross_entropy_kernel.py, imported only when one runs, so that CPU installs need no Triton.
"""
from __future__ import annotations

import torch

from . import dispatch
from .reference import cross_entropy_grad_reference, cross_entropy_stats_reference


def cross_entropy_stats(logits: torch.Tensor, target_col: torch.Tensor, real_cols: int, with_sum: bool = False):
    """Per row of logits [n, v] (contiguous last dim): (max, sum exp(x - max), x[target_col], sum x), fp32 [n].

    target_col [n] int: the target's local column, or -1 when it is not in this shard (logit 0).
    Only the first real_cols columns count (none: max -inf, sum exp 0). The sum is 0 unless with_sum.
    """
    if dispatch.pick(logits) != "triton":
        return cross_entropy_stats_reference(logits, target_col, real_cols, with_sum)
    from .cross_entropy_kernel import triton_cross_entropy_stats
    return triton_cross_entropy_stats(logits, target_col, real_cols, with_sum)


def cross_entropy_grad(logits: torch.Tensor, lse: torch.Tensor, target_col: torch.Tensor, row_scale: torch.Tensor,
                       real_cols: int, label_smoothing: float = 0.0, num_classes: int = 1, z_loss: float = 0.0,
                       out: torch.Tensor = None) -> torch.Tensor:
    """d loss / d logits [n, v]: row_scale * (softmax(1 + 2 z lse) - (1 - ls) onehot - ls / num_classes).

    lse [n] fp32 is the global log-sum-exp, row_scale [n] the upstream gradient (0 at ignored rows).
    Padding columns (>= real_cols) get 0. `out` (e.g. logits itself, for an in-place gradient)
    receives the result; a new tensor of logits' dtype otherwise.
    """
    if dispatch.pick(logits) != "triton":
        grad = cross_entropy_grad_reference(logits, lse, target_col, row_scale, real_cols, label_smoothing,
                                            num_classes, z_loss)
        return out.copy_(grad) if out is not None else grad
    from .cross_entropy_kernel import triton_cross_entropy_grad
    return triton_cross_entropy_grad(logits, lse, target_col, row_scale, real_cols, label_smoothing, num_classes,
                                     z_loss, out)
