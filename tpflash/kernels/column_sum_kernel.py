"""Triton fp32 column sum of a [rows, cols] matrix (bias gradients): deterministic, no atomics.

A 2-D grid: column blocks of BLOCK_C columns x row splits. A program adds up its split's rows of
its column block, [BLOCK_R, BLOCK_C] tiles at a time, in an fp32 [BLOCK_R, BLOCK_C] accumulator
that it reduces over rows once at the end; it writes one row of an fp32 [splits, cols] partials
buffer, and the same kernel with one split sums those (`sum_partials`, which the other kernels'
partial sums end with too). The launch is a fixed rule of the shape and the SM count, so the same
shapes on the same GPU model give the same bits every run.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# The launch: [BLOCK_R, BLOCK_C] tiles, and as many row splits as give PROGRAMS_PER_SM programs per SM
# over all column blocks, each with at least one tile of rows: [8192, 2048] on 132 SMs is 64 column
# blocks x 8 splits of 1024 rows. Chosen on an H200 in CUDA graphs over bf16 [8192 | 16384, 2048],
# [4096, 1024] and [8192, 5120 | 6144 | 8192] among blocks of 32-128 columns, tiles of 32-128 rows,
# 2-16 programs per SM and 4 or 8 warps: best or within 3% of it on the [*, 2048], [8192, 5120] and
# [8192, 6144]; 5-7% behind 64-column blocks on [8192, 8192] (they lose 4-20% on narrower shapes),
# 10-20% behind fewer programs on the small [4096, 1024].
BLOCK_C = 32  # columns of a program: 64 contiguous bytes of a bf16 row, 4 lanes of 16-byte loads
BLOCK_R = 128  # rows of a tile: an 8 KB bf16 tile, 16 fp32 accumulators per thread
PROGRAMS_PER_SM = 4  # 32 warps per SM keep enough loads in flight; each program still reads a long run
WARPS = 8
INTERPRET_SMS = 1  # stands in for the SM count on CPU (the interpreter runs programs one by one)


@triton.jit
def _column_sum_kernel(X, PARTIALS, rows, cols, stride_row, rows_per_split, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    in_cols = c < cols
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for start in tl.range(first, last, BLOCK_R):
        r = start + tl.arange(0, BLOCK_R)
        mask = (r < last)[:, None] & in_cols[None, :]
        acc += tl.load(X + r.to(tl.int64)[:, None] * stride_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(PARTIALS + split * cols + c, tl.sum(acc, 0), mask=in_cols)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _row_split(rows: int, column_blocks: int, sms: int, block_r: int = BLOCK_R, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Rows per split (a multiple of block_r): enough splits that the grid has `per_sm` programs per
    SM, none of them with less than one tile of rows."""
    splits = max(1, min(triton.cdiv(per_sm * sms, column_blocks), triton.cdiv(rows, block_r)))
    return max(block_r, triton.cdiv(triton.cdiv(rows, splits), block_r) * block_r)


def triton_column_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 [cols] sum over the rows of x [rows, cols] (any row stride, last-dim stride 1)."""
    rows, cols = x.shape
    sms = _sm_count(x.device) if x.is_cuda else INTERPRET_SMS
    column_blocks = triton.cdiv(cols, BLOCK_C)
    rows_per_split = _row_split(rows, column_blocks, sms)
    splits = max(1, triton.cdiv(rows, rows_per_split))  # one split of no rows writes the zeros of an empty x
    partials = torch.empty(splits, cols, device=x.device, dtype=torch.float32)
    _column_sum_kernel[(column_blocks, splits)](x, partials, rows, cols, x.stride(0), rows_per_split,
                                                BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=WARPS)
    return sum_partials(partials)


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """fp32 [cols]: the sum over the rows of a contiguous fp32 [splits, cols] buffer of partial sums, in
    one launch of the kernel above with a single split (a program per BLOCK_C columns). torch's sum
    over a few to a few hundred rows ran 4-6 us a call, latency-bound on a grid of a block per 64-128
    columns, and a gpt-2.7b step at tp=4 makes about 190 of them (docs/performance.md, "TP efficiency")."""
    splits, cols = partials.shape
    out = torch.empty(1, cols, device=partials.device, dtype=torch.float32)
    _column_sum_kernel[(triton.cdiv(cols, BLOCK_C), 1)](partials, out, splits, cols, cols, splits,
                                                        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=WARPS)
    return out[0]
