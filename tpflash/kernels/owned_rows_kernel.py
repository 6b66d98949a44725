"""Triton copy of the rows whose ids lie in [lo, hi) (tpflash.kernels.owned_rows).

One program per ROWS rows of dst: it loads their ids, then moves the owned rows BLOCK_D features at a
time, reading src at the row the id names (a table lookup) or at the same row, with loads and stores
masked to the owned rows (and the rows to zero): where dst or src is a peer's memory, the other rows
cost no NVLink traffic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS, BLOCK_D, WARPS = 8, 512, 4
INTERPRET_ROWS, INTERPRET_BLOCK_D = 4, 16


@triton.jit
def _owned_rows_kernel(IDS, SRC, DST, n, dim, lo, hi, valid_hi, LOOKUP: tl.constexpr, ZERO: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n
    ids = tl.load(IDS + rows, mask=in_range, other=-1).to(tl.int64)
    owned = in_range & (ids >= lo) & (ids < hi)
    if LOOKUP:
        src_rows = tl.where(owned, ids - lo, 0)
    else:
        src_rows = rows
    if ZERO == 2:  # owned_rows.ZERO_UNOWNED
        written = in_range
    elif ZERO == 1:  # ZERO_INVALID
        written = owned | (in_range & ((ids < 0) | (ids >= valid_hi)))
    else:
        written = owned
    for start in range(0, dim, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        values = tl.load(SRC + src_rows[:, None] * dim + cols[None, :], mask=owned[:, None] & col_ok[None, :],
                         other=0.0)
        tl.store(DST + rows[:, None] * dim + cols[None, :], values, mask=written[:, None] & col_ok[None, :])


def triton_copy_owned_rows(ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lo: int, hi: int,
                           lookup: bool, zero: int, valid_hi: int) -> None:
    """copy_owned_rows on the Triton backend (arguments checked by the caller)."""
    n, dim = dst.shape
    rows, block_d = (INTERPRET_ROWS, INTERPRET_BLOCK_D) if dst.device.type == "cpu" else (ROWS, BLOCK_D)
    block_d = min(block_d, triton.next_power_of_2(dim))
    _owned_rows_kernel[(triton.cdiv(n, rows),)](ids, src, dst, n, dim, lo, hi, valid_hi, LOOKUP=lookup,
                                                ZERO=zero, ROWS=rows, BLOCK_D=block_d, num_warps=WARPS)
