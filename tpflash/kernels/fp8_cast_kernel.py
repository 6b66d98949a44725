"""Triton fp8 casts with current scaling (amax, scale and cast of a [rows, cols] matrix in one or two
passes) or delayed scaling (one pass), equal bit for bit to tpflash.kernels.fp8.quantize.

How the scales are taken (SCALE_BY):
  ROWS     one per row (scale [rows, 1]): a cast program owns BLOCK_R whole rows, takes their amax in
           a first loop over the columns and casts in a second; the second read of a row finds it in
           the cache, so x is read from memory once.
  COLUMNS  one per column ([1, cols]): `_amax_kernel` writes the columns' maxima over row splits
           (fp32 [splits, cols]); each cast program casts one [BLOCK_R, BLOCK_C] tile after taking its
           columns' maxima over the splits. Two reads of x.
  TENSOR   one ([]): `_amax_kernel` writes one maximum per program (fp32 [programs]), or the caller
           gives the amax (e.g. reduced over ranks; then x is read once); every cast program reduces
           them first, so no launch sits between the two kernels. With PAST_AMAX the given values are
           an amax history's previous entries (delayed scaling; all zeros scale by 1), and with
           RECORD every program max-es the amax of its tile into the history's current entry.
The cast writes x8 row-major ([rows, cols] contiguous), column-major (the same matrix stored as a
contiguous [cols, rows]: torch._scaled_mm's second operand, and the transpose of its first), or both
from one read (16-bit x; for fp32 x, the row-major bytes transposed: see triton_cast). Scales follow quantize's
formula, operation for operation: quant = (1 / max(amax, 1e-12)) * FP8_MAX (a Python float over a
tensor is reciprocal-then-multiply in torch), scale = 1 / quant, both divisions IEEE-rounded (div_rn:
Triton's `/` is approximate on CUDA). A NaN in a slice makes its amax, and so its whole slice, NaN,
as in quantize: an overflowed gradient stays visible.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ROWS, COLUMNS, TENSOR = 0, 1, 2
# per format: (largest value, mantissa bits, exponent of the smallest normal)
FORMATS = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _reciprocal(v):
    return tl.math.div_rn(tl.full(v.shape, 1.0, tl.float32), v)


@triton.jit
def _quant(amax, FP8_MAX: tl.constexpr):
    """fp32 FP8_MAX / max(amax, 1e-12) as quantize computes it: the reciprocal, then the product."""
    return _reciprocal(_max_nan(amax, 1e-12)) * FP8_MAX  # 1e-12: quantize's _AMAX_FLOOR; a NaN amax stays NaN


@triton.jit
def _tensor_quant(AMAX, amax_count, PAST_AMAX: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_A: tl.constexpr):
    """The quant of one tensor scale: from the maximum of AMAX[:amax_count] (partial maxima, or with
    PAST_AMAX an amax history's previous entries, all-zero meaning a scale of 1)."""
    amax = tl.zeros([BLOCK_A], tl.float32)
    for a in tl.range(0, amax_count, BLOCK_A):
        i = a + tl.arange(0, BLOCK_A)
        amax = _max_nan(amax, tl.load(AMAX + i, mask=i < amax_count, other=0.0))
    amax = tl.reduce(amax, 0, _max_nan)
    if PAST_AMAX:  # nothing recorded yet, or all-zero tensors
        amax = tl.where(amax == 0.0, FP8_MAX, amax)
    return _quant(amax, FP8_MAX)


@triton.jit
def _on_fp8_grid(v, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 v clamped to +-FP8_MAX and rounded to the nearest fp8 value (ties to even), still fp32.

    Why round here rather than leave it to the cast: the cast after it is then exact, so every backend
    gives the same bits. Triton's CPU interpreter (3.9) rounds fp32 -> fp8 without carrying into the
    exponent (124.1 -> 64 in e4m3), rounds ties away from zero and truncates subnormals; on CUDA the
    cast of an fp8 value is exact, so this costs a few ALU operations in a memory-bound kernel and
    the CPU tests can compare bits with quantize. The fp8 values near |v| are spaced 2^q apart,
    q = max(exponent of v, MIN_EXP) - MANTISSA (the subnormals share MIN_EXP's spacing); adding
    2^(q + 23) rounds |v| to a multiple of 2^q (fp32 addition rounds to nearest even at that
    magnitude, and the carry of a round-up lands in the exponent by itself); subtracting it is exact.
    """
    v = tl.minimum(tl.maximum(v, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    bits = v.to(tl.uint32, bitcast=True)
    exponent = (bits >> 23) & 0xFF  # biased by 127; 0 for zero (and fp32 subnormals)
    magic = ((tl.maximum(exponent, MIN_EXP + 127) + (23 - MANTISSA)) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic
    return (rounded.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _amax_kernel(X, PARTIALS, rows, cols, stride_row, rows_per_split, PER_COLUMN: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # program (column block, row split): max |x| over its [rows_per_split, BLOCK_C] strip, into
    # PARTIALS [splits, cols] (PER_COLUMN) or [splits, column blocks] (one value)
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    in_cols = c < cols
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for start in tl.range(first, last, BLOCK_R):
        r = (start + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (r < last)[:, None] & in_cols[None, :]
        x = tl.load(X + r[:, None] * stride_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = _max_nan(acc, tl.abs(x))
    if PER_COLUMN:
        tl.store(PARTIALS + split * cols + c, tl.reduce(acc, 0, _max_nan), mask=in_cols)
    else:
        block_max = tl.reduce(tl.reduce(acc, 1, _max_nan), 0, _max_nan)
        tl.store(PARTIALS + split * tl.num_programs(0) + tl.program_id(0), block_max)


@triton.jit
def _cast_kernel(X, OUT_ROW, OUT_COL, SCALE, AMAX, RECORD, rows, cols, stride_row, stride_col, amax_count,
                 SCALE_BY: tl.constexpr, PAST_AMAX: tl.constexpr, WITH_RECORD: tl.constexpr, WRITE_ROW: tl.constexpr,
                 WRITE_COL: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
    # program (row block, column block): rows [BLOCK_R], all columns (ROWS) or BLOCK_C of them
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = r < rows
    r64 = r.to(tl.int64)  # rows * cols passes 2^31 at real sizes
    if SCALE_BY == 0:  # ROWS: the amax of whole rows, then the cast of the same rows
        first, last = 0, cols
        amax = tl.zeros([BLOCK_R], tl.float32)
        for k in tl.range(0, cols, BLOCK_C):
            c = k + tl.arange(0, BLOCK_C)
            mask = in_rows[:, None] & (c < cols)[None, :]
            x = tl.load(X + r64[:, None] * stride_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = _max_nan(amax, tl.reduce(tl.abs(x), 1, _max_nan))
        quant = _quant(amax, FP8_MAX)
        tl.store(SCALE + r, _reciprocal(quant), mask=in_rows)
        quant = quant[:, None]
    else:
        first = tl.program_id(1) * BLOCK_C
        last = tl.minimum(first + BLOCK_C, cols)
        if SCALE_BY == 1:  # COLUMNS: AMAX [amax_count, cols]
            c = first + tl.arange(0, BLOCK_C)
            amax = tl.zeros([BLOCK_C], tl.float32)
            for s in tl.range(0, amax_count):
                amax = _max_nan(amax, tl.load(AMAX + s * cols + c, mask=c < cols, other=0.0))
            quant = _quant(amax, FP8_MAX)
            if tl.program_id(0) == 0:
                tl.store(SCALE + c, _reciprocal(quant), mask=c < cols)
            quant = quant[None, :]
        else:  # TENSOR: AMAX [amax_count]
            quant = _tensor_quant(AMAX, amax_count, PAST_AMAX, FP8_MAX, BLOCK_A)
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(SCALE, _reciprocal(quant))
    seen = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)  # WITH_RECORD: max |x| of this program's tile
    for k in tl.range(first, last, BLOCK_C):
        c = k + tl.arange(0, BLOCK_C)
        mask = in_rows[:, None] & (c < cols)[None, :]
        x = tl.load(X + r64[:, None] * stride_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if WITH_RECORD:
            seen = _max_nan(seen, tl.abs(x))
        x8 = _on_fp8_grid(x * quant, FP8_MAX, MANTISSA, MIN_EXP)
        if WRITE_ROW:
            tl.store(OUT_ROW + r64[:, None] * cols + c[None, :], x8.to(OUT_ROW.dtype.element_ty), mask=mask)
        if WRITE_COL:
            tl.store(OUT_COL + c.to(tl.int64)[None, :] * stride_col + r[:, None], x8.to(OUT_COL.dtype.element_ty),
                     mask=mask)
    if WITH_RECORD:  # |x| >= 0, so the float maximum is the integer one of the bits: NaN (0x7fc00000) wins too
        tl.atomic_max(RECORD, tl.reduce(tl.reduce(seen, 1, _max_nan), 0, _max_nan).to(tl.int32, bitcast=True))


@triton.jit
def _transpose_kernel(X, OUT, rows, cols, stride_row, stride_out, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # program (row block, column block): one [BLOCK_R, BLOCK_C] tile of x [rows, cols] (row-major bytes)
    # stored into OUT's columns (OUT[c * stride_out + r]); the cast's column-major store, without the cast
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(X + r.to(tl.int64)[:, None] * stride_row + c[None, :], mask=mask)
    tl.store(OUT + c.to(tl.int64)[None, :] * stride_out + r[:, None], x, mask=mask)


# Launches: [BLOCK_R, BLOCK_C] tiles, warps and (amax passes) programs per SM, per kind of program.
# Timed on an H200 at llama-1b's per-block shapes, each input out of L2 (docs/fp8.md, "Where the casts
# and GEMMs run"): the casts move 2.4-2.8 TB/s and no tile of 32-128 rows by 64-256 columns was more
# than 1.5% faster than 64 x 64 (whose column-major stores write 64 contiguous bytes per column;
# Triton routes the transpose through shared memory). ROWS: one row per program, in tiles of up to
# CAST_ROWS_MAX_C columns (a bf16 row of 4096 is 8 KB: the in-flight rows of all SMs stay in L2 for
# their second read). The tensor amax pass reads rows 256 bytes wide (bf16) with 8 programs per SM,
# 11% faster than the per-column pass's tile (64 bf16 bytes of 128 rows, column_sum_kernel's, whose
# few row splits keep the partial maxima each column cast reduces small).
CAST_ROWS = {"BLOCK_R": 1, "WARPS": 4}
CAST_ROWS_MAX_C = 4096
CAST_TILE = {"BLOCK_R": 64, "BLOCK_C": 64, "WARPS": 4}
AMAX_COLUMNS = {"BLOCK_R": 128, "BLOCK_C": 32, "WARPS": 8, "PER_SM": 4}
AMAX_TENSOR = {"BLOCK_R": 8, "BLOCK_C": 128, "WARPS": 8, "PER_SM": 8}
BLOCK_A = 1024  # the TENSOR cast reduces the amax partials BLOCK_A at a time
# CPU (interpreter): small tiles, so that tiny shapes have several tiles, loops and ragged edges
INTERPRET_LAUNCH = {"BLOCK_R": 4, "BLOCK_C": 8, "WARPS": 1}
INTERPRET_SMS, INTERPRET_BLOCK_A = 4, 8


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def triton_amax(x: torch.Tensor, per_column: bool) -> torch.Tensor:
    """Partial maxima of |x| (fp32), x [rows, cols] (any row stride, last-dim stride 1): [splits, cols]
    per column, else [splits * column blocks], whose max is the amax of x."""
    rows, cols = x.shape
    cfg = (AMAX_COLUMNS if per_column else AMAX_TENSOR) if x.is_cuda else dict(INTERPRET_LAUNCH, PER_SM=4)
    sms = _sm_count(x.device) if x.is_cuda else INTERPRET_SMS
    column_blocks = triton.cdiv(cols, cfg["BLOCK_C"])
    splits = max(1, min(triton.cdiv(cfg["PER_SM"] * sms, column_blocks), triton.cdiv(rows, cfg["BLOCK_R"])))
    rows_per_split = triton.cdiv(triton.cdiv(rows, splits), cfg["BLOCK_R"]) * cfg["BLOCK_R"]
    splits = triton.cdiv(rows, rows_per_split)
    partials = torch.empty(splits, cols if per_column else column_blocks, device=x.device, dtype=torch.float32)
    _amax_kernel[(column_blocks, splits)](x, partials, rows, cols, x.stride(0), rows_per_split, PER_COLUMN=per_column,
                                          BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["WARPS"])
    return partials if per_column else partials.view(-1)


def triton_cast(x: torch.Tensor, dtype: torch.dtype, scale_by: int, amax=None, row: bool = True, col: bool = False,
                out_row: torch.Tensor = None, out_col: torch.Tensor = None, past: bool = False,
                record: torch.Tensor = None):
    """(x8 row-major if `row`, x8 column-major if `col` (else None), fp32 scale) of x [rows, cols]
    (rows, cols > 0; any row stride, last-dim stride 1; bf16, fp16 or fp32) in fp8 `dtype`, scaled by
    ROWS (scale [rows, 1]), COLUMNS ([1, cols]) or TENSOR ([]). amax, for COLUMNS and TENSOR: the
    partial maxima to reduce (triton_amax's), or for TENSOR a given fp32 amax of one element; None
    takes them from x. Column-major x8 is [rows, cols] with strides (1, rows). out_row, out_col: fp8
    [rows, cols] tensors to write the layouts into instead (rows of larger buffers: strides (cols, 1)
    and (1, ld) with ld >= rows). past (TENSOR): `amax` is an amax history's previous entries, whose
    maximum scales x, an all-zero history scaling by 1. record: a 1-element fp32 tensor that max |x|
    is max-ed into (NaN wins), as the cast reads x."""
    rows, cols = x.shape
    if scale_by != ROWS and amax is None:
        amax = triton_amax(x, per_column=scale_by == COLUMNS)
    if row and out_row is None:
        out_row = torch.empty(rows, cols, device=x.device, dtype=dtype)
    if col and out_col is None:
        out_col = torch.empty(cols, rows, device=x.device, dtype=dtype).t()
    out_row, out_col = out_row if row else None, out_col if col else None
    scale = torch.empty({ROWS: (rows, 1), COLUMNS: (1, cols), TENSOR: ()}[scale_by], device=x.device,
                        dtype=torch.float32)
    amax_count = 0 if amax is None else amax.shape[0] if amax.dim() == 2 else amax.numel()
    if x.is_cuda:
        cfg = dict(CAST_ROWS, BLOCK_C=min(triton.next_power_of_2(cols), CAST_ROWS_MAX_C)) if scale_by == ROWS \
            else CAST_TILE
    else:
        cfg = INTERPRET_LAUNCH
    column_programs = 1 if scale_by == ROWS else triton.cdiv(cols, cfg["BLOCK_C"])
    fp8_max, mantissa, min_exp = FORMATS[dtype]
    # Both layouts of an fp32 x: the row-major cast, then its bytes transposed (on every device, so the
    # CPU tests run this path too). The kernel writing both from one read of fp32 x wrote wrong
    # column-major bytes on an H200 (Triton 3.6) for shapes divisible by 16, whichever store came first
    # and whether the tile went through bf16 or tl.trans, while either store alone, and both from 16-bit
    # x, are exact (tests/kernels/test_fp8_cast.py). The transpose moves 2 bytes an element where a
    # second cast would read fp32's 4 again and write 1.
    transpose = row and col and x.dtype == torch.float32
    _cast_kernel[(triton.cdiv(rows, cfg["BLOCK_R"]), column_programs)](
        x, out_row, out_col, scale, amax, None if record is None else record.view(torch.int32), rows, cols,
        x.stride(0), out_col.stride(1) if col else 0, amax_count, SCALE_BY=scale_by, PAST_AMAX=past,
        WITH_RECORD=record is not None,
        WRITE_ROW=row, WRITE_COL=col and not transpose, FP8_MAX=fp8_max, MANTISSA=mantissa, MIN_EXP=min_exp,
        BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_C"], BLOCK_A=BLOCK_A if x.is_cuda else INTERPRET_BLOCK_A,
        num_warps=cfg["WARPS"])
    if transpose:
        triton_column_major(out_row, out_col)
    return out_row, out_col, scale


def triton_column_major(x8: torch.Tensor, out: torch.Tensor = None) -> torch.Tensor:
    """x8 [rows, cols] (row-major, last-dim stride 1, one byte an element) stored column-major: into
    `out` ([rows, cols] with strides (1, ld), ld >= rows: rows of a larger column-major buffer) or a new
    [rows, cols] with strides (1, rows), the .t() of a contiguous [cols, rows]. A copy at the cast's
    store speed (torch's strided copy of one-byte elements is several times slower)."""
    rows, cols = x8.shape
    if out is None:
        out = torch.empty(cols, rows, device=x8.device, dtype=x8.dtype).t()
    cfg = CAST_TILE if x8.is_cuda else INTERPRET_LAUNCH
    grid = (triton.cdiv(rows, cfg["BLOCK_R"]), triton.cdiv(cols, cfg["BLOCK_C"]))
    # as bytes: the interpreter has no fp8 loads and stores
    _transpose_kernel[grid](x8.view(torch.uint8), out.view(torch.uint8), rows, cols, x8.stride(0), out.stride(1),
                            BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["WARPS"])
    return out
