"""Triton concatenation of up to three matrices along their columns, with the fp32 column sums of the
result computed in the same pass (the stacked q/k/v or up/gate gradient, and its bias gradient).

The stacked layers' backward concatenates the gradients of their outputs into one [tokens, sum out]
matrix for one GEMM, and with biases sums that matrix's columns: torch.cat and column_sum each pass
over it. Here each program copies a [rows of its split, BLOCK_C columns] block of one part into the
output and keeps the column sums in registers: one read and one write instead of two reads and a
write. A part is read through (outer, inner) row strides, so the attention's gradients, [s, b, c]
views of [b, s, c] memory, need no copy first. The grid and the deterministic partial sums are
bias_activation_kernel's ([splits, cols] fp32, summed by column_sum_kernel.sum_partials, no atomics; a
fixed launch rule).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import triton
import triton.language as tl

from .bias_activation_kernel import LAUNCH, _grid_rows
from .column_sum_kernel import INTERPRET_SMS, _sm_count, sum_partials

INTERPRET_LAUNCH = {"BLOCK_R": 16, "BLOCK_C": 32, "WARPS": 4, "PER_SM": 4, "STAGES": 1}


@triton.jit
def _copy_block_with_sum(X, OUT, PARTIALS, block, first, last, inner, cols, stride_outer, stride_inner,
                         col_offset, total_cols, split, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         STAGES: tl.constexpr):
    c = block * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = c < cols
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for start in tl.range(first, last, BLOCK_R, num_stages=STAGES):
        r = start + tl.arange(0, BLOCK_R)
        mask = (r < last)[:, None] & in_cols[None, :]
        r64 = r.to(tl.int64)
        src = (r64 // inner) * stride_outer + (r64 % inner) * stride_inner
        x = tl.load(X + src[:, None] + c[None, :], mask=mask, other=0.0)
        tl.store(OUT + r64[:, None] * total_cols + (col_offset + c)[None, :], x, mask=mask)
        acc += x.to(tl.float32)
    tl.store(PARTIALS + split * total_cols + col_offset + c, tl.sum(acc, 0), mask=in_cols)


@triton.jit
def _concat_sum_kernel(A, B, C, OUT, PARTIALS, rows, inner, cols_a, cols_b, cols_c, so_a, si_a, so_b, si_b,
                       so_c, si_c, total_cols, rows_per_split, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       STAGES: tl.constexpr):
    # column blocks are numbered part by part: A's, then B's, then C's
    block, split = tl.program_id(0), tl.program_id(1)
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, rows)
    blocks_a = tl.cdiv(cols_a, BLOCK_C)
    blocks_b = tl.cdiv(cols_b, BLOCK_C)
    if block < blocks_a:
        _copy_block_with_sum(A, OUT, PARTIALS, block, first, last, inner, cols_a, so_a, si_a, 0, total_cols,
                             split, BLOCK_R, BLOCK_C, STAGES)
    elif block < blocks_a + blocks_b:
        _copy_block_with_sum(B, OUT, PARTIALS, block - blocks_a, first, last, inner, cols_b, so_b, si_b, cols_a,
                             total_cols, split, BLOCK_R, BLOCK_C, STAGES)
    else:
        _copy_block_with_sum(C, OUT, PARTIALS, block - blocks_a - blocks_b, first, last, inner, cols_c, so_c,
                             si_c, cols_a + cols_b, total_cols, split, BLOCK_R, BLOCK_C, STAGES)


def _row_strides(x: torch.Tensor) -> Tuple[int, int]:
    """(stride of the outer row index, of the inner one) of x [outer, inner, c] or [rows, c] (inner 1)."""
    return (x.stride(0), x.stride(1)) if x.dim() == 3 else (x.stride(0), 0)


def triton_concat_with_column_sum(parts: Sequence[torch.Tensor], launch=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(torch.cat(parts, -1) as a contiguous [rows, sum cols] matrix, its fp32 [sum cols] column sums)
    for 1-3 parts of one dtype, each [rows, c_i] or [outer, inner, c_i] (the same leading sizes) with
    last-dim stride 1. `launch` overrides keys of the launch rule (benchmarks/tune_bias_activation.py)."""
    lead = parts[0].shape[:-1]
    rows, inner = lead.numel(), (lead[1] if len(lead) == 2 else 1)
    cols = [p.shape[-1] for p in parts]
    total = sum(cols)
    x = parts[0]
    cfg = dict(LAUNCH[True] if x.is_cuda else INTERPRET_LAUNCH, **(launch or {}))
    sms = _sm_count(x.device) if x.is_cuda else INTERPRET_SMS
    column_blocks = sum(triton.cdiv(c, cfg["BLOCK_C"]) for c in cols)
    rows_per_split, splits = _grid_rows(rows, column_blocks, sms, cfg)
    out = torch.empty(rows, total, device=x.device, dtype=x.dtype)
    partials = torch.empty(splits, total, device=x.device, dtype=torch.float32)
    padded = list(parts) + [parts[0]] * (3 - len(parts))  # unused parts: 0 columns, never read
    cols = cols + [0] * (3 - len(cols))
    strides = [s for p in padded for s in _row_strides(p)]
    _concat_sum_kernel[(column_blocks, splits)](
        *padded, out, partials, rows, inner, *cols, *strides, total, rows_per_split,
        BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_C"], STAGES=cfg["STAGES"], num_warps=cfg["WARPS"])
    return out, sum_partials(partials)
