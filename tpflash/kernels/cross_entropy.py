"""Row kernels of the (vocab-parallel) cross-entropy: statistics in one pass, gradient in one pass.

`cross_entropy_stats` reads each row of a logits shard once and returns, per row, the max, the sum
of exp(x - max) (an online softmax over vocabulary blocks), the logit at the target column and the
sum of the logits (for label smoothing). The loss code combines these across tp ranks.
`cross_entropy_grad` writes d loss / d logits, optionally into the logits buffer itself.
Both skip the padding columns at and past `real_cols`. No process groups here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dispatch
from .reference import cross_entropy_grad_reference, cross_entropy_stats_reference


def _block(v: int) -> int:
    return 64 if dispatch.interpreting() else min(triton.next_power_of_2(v), 8192)


@triton.jit
def _ce_stats_kernel(X, T, MAX, SUMEXP, PICKED, TOTAL, stride_row, real_cols, BLOCK: tl.constexpr,
                     WITH_SUM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_row
    # running max and sum of exp(x - max) over the blocks so far (fp32 scalars)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, real_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < real_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))  # finite: every block holds at least one real column
        s = s * tl.exp2((m - m_new) * 1.4426950408889634) + tl.sum(tl.exp2((x - m_new) * 1.4426950408889634), 0)
        m = m_new
        if WITH_SUM:
            total += tl.where(cols < real_cols, x, 0.0)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    t = tl.load(T + row)
    picked = tl.load(X + tl.maximum(t, 0)).to(tl.float32)
    tl.store(PICKED + row, tl.where(t >= 0, picked, 0.0))
    tl.store(TOTAL + row, tl.sum(total, 0))


@triton.jit
def _ce_grad_kernel(X, G, LSE, T, SCALE, stride_row, stride_grow, cols_total, real_cols, smooth_target,
                    smooth_each, z_loss, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(LSE + row)
    t = tl.load(T + row)
    scale = tl.load(SCALE + row)
    p_scale = scale * (1.0 + 2.0 * z_loss * lse)
    for start in range(0, cols_total, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_row + cols, mask=cols < cols_total, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * p_scale - scale * (smooth_each + tl.where(cols == t, smooth_target, 0.0))
        g = tl.where(cols < real_cols, g, 0.0)
        tl.store(G + row * stride_grow + cols, g.to(G.dtype.element_ty), mask=cols < cols_total)


def cross_entropy_stats(logits: torch.Tensor, target_col: torch.Tensor, real_cols: int, with_sum: bool = False):
    """Per row of logits [n, v] (contiguous last dim): (max, sum exp(x - max), x[target_col], sum x), fp32 [n].

    target_col [n] int: the target's local column, or -1 when it is not in this shard (logit 0).
    Only the first real_cols columns count. The sum is 0 unless with_sum.
    """
    if dispatch.pick(logits) != "triton":
        return cross_entropy_stats_reference(logits, target_col, real_cols, with_sum)
    n = logits.shape[0]
    out = torch.empty(4, n, device=logits.device, dtype=torch.float32)
    if n:
        _ce_stats_kernel[(n,)](logits, target_col.contiguous(), out[0], out[1], out[2], out[3], logits.stride(0),
                               real_cols, BLOCK=_block(real_cols), WITH_SUM=with_sum,
                               num_warps=1 if dispatch.interpreting() else 16)
    return out[0], out[1], out[2], out[3]


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
    if out is None:
        out = torch.empty_like(logits)
    n, v = logits.shape
    if n:
        _ce_grad_kernel[(n,)](logits, out, lse.contiguous(), target_col.contiguous(), row_scale.float().contiguous(),
                              logits.stride(0), out.stride(0), v, real_cols, 1.0 - label_smoothing,
                              label_smoothing / num_classes, z_loss, BLOCK=_block(v),
                              num_warps=1 if dispatch.interpreting() else 16)
    return out
