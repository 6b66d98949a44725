"""Row kernels of the (vocab-parallel) cross-entropy: statistics in one pass, gradient in one pass.

`cross_entropy_stats` reads each row of a logits shard once and returns, per row, the max, the sum
of exp(x - max), the logit at the target column and the sum of the logits (for label smoothing).
The loss code combines these across tp ranks. The statistics are split over the vocabulary: program
(row, c) reduces columns [c * CHUNK, (c + 1) * CHUNK) of its row to partials (max, sum exp relative
to that max, sum), so a row of 128K columns keeps dozens of programs loading at once instead of one;
a second small kernel merges a row's partials the way tp ranks merge theirs, and picks the target.
`cross_entropy_grad` writes d loss / d logits, optionally into the logits buffer itself.
Both skip the padding columns at and past `real_cols`. No process groups here.

The public entry points with their reference fallbacks are in cross_entropy.py, which imports
this module only when a Triton kernel runs (Triton is not needed on CPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import dispatch

# (CHUNK, BLOCK, warps) candidates for the statistics on a GPU: a program reads CHUNK columns as
# CHUNK / BLOCK tiles of BLOCK. (4096, 128256) bf16 logits give 4096 x 8-63 programs of 4-32 KB each.
STATS_SHAPES = [(2048, 2048, 4), (4096, 4096, 4), (4096, 4096, 8), (8192, 8192, 8), (8192, 4096, 8),
                (16384, 4096, 8)]
# under the CPU interpreter: two tiles per chunk, so that tests cover the tile loop and its padding tiles
INTERPRET_STATS = {"CHUNK": 128, "BLOCK": 64, "num_warps": 1}


def _block(v: int) -> int:
    return 64 if dispatch.interpreting() else min(triton.next_power_of_2(v), 8192)


@triton.jit
def _ce_stats_kernel(X, PART_MAX, PART_SUMEXP, PART_SUM, stride_row, stride_part, real_cols, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr, WITH_SUM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    X += row * stride_row
    # running max and sum of exp(x - max) over the chunk's tiles so far (fp32 scalars)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, CHUNK, BLOCK):
        cols = chunk * CHUNK + start + tl.arange(0, BLOCK)
        x = tl.load(X + cols, mask=cols < real_cols, other=float("-inf")).to(tl.float32)  # [BLOCK]
        m_new = tl.maximum(m, tl.max(x, 0))
        # no finite value yet (a tile past real_cols, or of masked -inf logits): shift by 0, so
        # that exp gives 0 rather than exp(-inf - -inf) = NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp2((m - shift) * 1.4426950408889634) + tl.sum(tl.exp2((x - shift) * 1.4426950408889634), 0)
        m = m_new
        if WITH_SUM:
            total += tl.where(cols < real_cols, x, 0.0)
    at = row * stride_part + chunk
    tl.store(PART_MAX + at, m)
    tl.store(PART_SUMEXP + at, s)
    tl.store(PART_SUM + at, tl.sum(total, 0))


# the grid depends on the config (chunks = cdiv(real_cols, CHUNK)): the caller reads best_config
_ce_stats_tuned = triton.autotune(
    configs=[triton.Config({"CHUNK": c, "BLOCK": b}, num_warps=w) for c, b, w in STATS_SHAPES],
    key=["real_cols"])(_ce_stats_kernel)


@triton.jit
def _ce_combine_kernel(PART_MAX, PART_SUMEXP, PART_SUM, X, T, MAX, SUMEXP, PICKED, TOTAL, n, chunks, stride_part,
                       stride_row, ROWS: tl.constexpr, CHUNKS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    c = tl.arange(0, CHUNKS)
    in_rows = rows < n
    mask = in_rows[:, None] & (c < chunks)[None, :]  # [ROWS, CHUNKS]
    at = rows[:, None].to(tl.int64) * stride_part + c[None, :]
    m = tl.load(PART_MAX + at, mask=mask, other=float("-inf"))
    s = tl.load(PART_SUMEXP + at, mask=mask, other=0.0)
    row_max = tl.max(m, 1)  # [ROWS]
    # -inf only when the row has no real column (real_cols == 0): its sum stays 0, not NaN
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    sum_exp = tl.sum(s * tl.exp2((m - shift[:, None]) * 1.4426950408889634), 1)  # a -inf partial max adds 0
    total = tl.sum(tl.load(PART_SUM + at, mask=mask, other=0.0), 1)
    t = tl.load(T + rows, mask=in_rows, other=-1)
    picked = tl.load(X + rows.to(tl.int64) * stride_row + tl.maximum(t, 0), mask=in_rows & (t >= 0), other=0.0)
    tl.store(MAX + rows, row_max, mask=in_rows)
    tl.store(SUMEXP + rows, sum_exp, mask=in_rows)
    tl.store(PICKED + rows, picked.to(tl.float32), mask=in_rows)
    tl.store(TOTAL + rows, total, mask=in_rows)


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


def _stats_partials(logits: torch.Tensor, real_cols: int, with_sum: bool):
    """(part, chunks): part fp32 [3, n, width] holds, at [:, row, c] for c < chunks, the max,
    sum exp(x - max) and sum x (0 unless with_sum) of chunk c's real columns.

    width fits the smallest candidate CHUNK, since the CHUNK the autotuner picks (hence `chunks`)
    is known only after the launch. Nothing is launched when real_cols == 0 (0 chunks).
    """
    n = logits.shape[0]
    smallest = INTERPRET_STATS["CHUNK"] if dispatch.interpreting() else min(c for c, _, _ in STATS_SHAPES)
    part = torch.empty(3, n, max(1, triton.cdiv(real_cols, smallest)), device=logits.device, dtype=torch.float32)
    if real_cols == 0:
        return part, 0
    args = (logits, part[0], part[1], part[2], logits.stride(0), part.stride(1), real_cols)
    if dispatch.interpreting():
        chunk = INTERPRET_STATS["CHUNK"]
        _ce_stats_kernel[(n, triton.cdiv(real_cols, chunk))](*args, WITH_SUM=with_sum, **INTERPRET_STATS)
    else:
        _ce_stats_tuned[lambda meta: (n, triton.cdiv(real_cols, meta["CHUNK"]))](*args, WITH_SUM=with_sum)
        chunk = _ce_stats_tuned.best_config.kwargs["CHUNK"]
    return part, triton.cdiv(real_cols, chunk)


def triton_cross_entropy_stats(logits: torch.Tensor, target_col: torch.Tensor, real_cols: int,
                               with_sum: bool = False):
    """The Triton implementation of cross_entropy.cross_entropy_stats (same arguments and results)."""
    n = logits.shape[0]
    out = torch.empty(4, n, device=logits.device, dtype=torch.float32)
    if n:
        part, chunks = _stats_partials(logits, real_cols, with_sum)
        width = triton.next_power_of_2(max(chunks, 1))
        rows = max(1, min(64, 1024 // width))  # a [rows, width] tile of partials per program: 8 per thread
        _ce_combine_kernel[(triton.cdiv(n, rows),)](part[0], part[1], part[2], logits, target_col.contiguous(),
                                                    out[0], out[1], out[2], out[3], n, chunks, part.stride(1),
                                                    logits.stride(0), ROWS=rows, CHUNKS=width,
                                                    num_warps=1 if dispatch.interpreting() else 4)
    return out[0], out[1], out[2], out[3]


def triton_cross_entropy_grad(logits: torch.Tensor, lse: torch.Tensor, target_col: torch.Tensor,
                              row_scale: torch.Tensor, real_cols: int, label_smoothing: float = 0.0,
                              num_classes: int = 1, z_loss: float = 0.0, out: torch.Tensor = None) -> torch.Tensor:
    """The Triton implementation of cross_entropy.cross_entropy_grad (same arguments and results)."""
    if out is None:
        out = torch.empty_like(logits)
    n, v = logits.shape
    if n:
        _ce_grad_kernel[(n,)](logits, out, lse.contiguous(), target_col.contiguous(), row_scale.float().contiguous(),
                              logits.stride(0), out.stride(0), v, real_cols, 1.0 - label_smoothing,
                              label_smoothing / num_classes, z_loss, BLOCK=_block(v),
                              num_warps=1 if dispatch.interpreting() else 16)
    return out
