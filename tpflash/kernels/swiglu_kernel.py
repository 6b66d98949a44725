"""Triton SwiGLU, silu(gate) * up, and its backward: one kernel, one flag (BACKWARD).

Forward: h = silu(g) * u, computed in fp32, stored in u's dtype. Backward, in one pass over dh, u and
g: du = dh * silu(g), dg = dh * u * s * (1 + g (1 - s)) with s = sigmoid(g), stored in dh's dtype.
Unfused, torch reads gate twice in the forward (silu, then the product) and the backward takes
several elementwise passes; here every tensor is read once and written once.
Every operand is a [rows, cols] view with its own row stride and last-dim stride 1: up and gate are
usually the two column halves of one [rows, 2 cols] GEMM output, and the two backward outputs can be
the two halves of one [rows, 2 cols] buffer (the GEMM's gradient, with no torch.cat).
With AMAX, each program also writes the largest |value| it stored (as stored, in the output dtype;
NaN wins) to AMAX[program]: the fp8 tensorwise GEMMs on either side take their input's amax from
there instead of reading the tensor once more.

Under fp8 delayed scaling, whose scales are known before the pass, `_swiglu_fp8_kernel` writes h in
e4m3 for the down GEMM and, backward, [du | dg] in e5m2 for the stacked up/gate GEMM's backward, each
row-major and column-major: the compute-dtype tensor is never written, nor read again by a cast.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_cast_kernel import FORMATS, _max_nan, _on_fp8_grid, _reciprocal, _tensor_quant


@triton.jit
def _swiglu_kernel(UP, GATE, DH, OUT, OUT_GATE, AMAX, rows, cols, stride_up, stride_gate, stride_dh, stride_out,
                   rows_per_program, BACKWARD: tl.constexpr, WITH_AMAX: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    # Forward: OUT = h. Backward: OUT = du, OUT_GATE = dg, both with row stride stride_out.
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = c < cols
    first = tl.program_id(1) * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    amax = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)  # masked lanes stay 0
    for start in range(first, last, BLOCK_R):
        r = (start + tl.arange(0, BLOCK_R)).to(tl.int64)  # rows * stride passes 2^31 at real sizes
        mask = (r < last)[:, None] & in_cols[None, :]
        u = tl.load(UP + r[:, None] * stride_up + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(GATE + r[:, None] * stride_gate + c[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        at = r[:, None] * stride_out + c[None, :]
        if BACKWARD:
            dh = tl.load(DH + r[:, None] * stride_dh + c[None, :], mask=mask, other=0.0).to(tl.float32)
            du = (dh * g * s).to(OUT.dtype.element_ty)
            dg = (dh * u * s * (1.0 + g * (1.0 - s))).to(OUT_GATE.dtype.element_ty)
            tl.store(OUT + at, du, mask=mask)
            tl.store(OUT_GATE + at, dg, mask=mask)
            if WITH_AMAX:
                amax = _max_nan(amax, _max_nan(tl.abs(du.to(tl.float32)), tl.abs(dg.to(tl.float32))))
        else:
            h = (g * s * u).to(OUT.dtype.element_ty)
            tl.store(OUT + at, h, mask=mask)
            if WITH_AMAX:
                amax = _max_nan(amax, tl.abs(h.to(tl.float32)))
    if WITH_AMAX:
        program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        tl.store(AMAX + program, tl.reduce(tl.reduce(amax, 1, _max_nan), 0, _max_nan))


# The launch per direction: [BLOCK_R, BLOCK_C] tiles, one tile per program unless the rows need more
# than MAX_ROW_PROGRAMS programs. A fixed choice, not swept: 1024-column rows in 16-byte bf16 lanes
# (bias_activation's swept forward tile); the backward keeps three loads and two stores in flight
# per tile, so it gets twice the warps. On an H100, bf16 halves [8192, 5632] of [8192, 11264]: the
# forward in 97 us (2.84 TB/s over its three tensors; torch's F.silu(g) * u 268 us), the backward
# in 157 us (2.94 TB/s over five), near the copy bandwidth: little left for a sweep to find.
LAUNCH = {False: {"BLOCK_R": 1, "BLOCK_C": 1024, "WARPS": 4},
          True: {"BLOCK_R": 1, "BLOCK_C": 1024, "WARPS": 8}}
INTERPRET_LAUNCH = {"BLOCK_R": 16, "BLOCK_C": 32, "WARPS": 1}  # CPU: small tiles, few programs
MAX_ROW_PROGRAMS = 65535  # CUDA's limit on the grid's second dimension
# With AMAX each program reduces its maxima once, at its end: over this many rows (at least), so that
# the reduction and the partial maxima it writes stay a small part of the pass.
AMAX_ROWS_PER_PROGRAM = 16


def _grid_rows(rows: int, cfg: dict, min_rows_per_program: int = 1):
    """(rows per program, row programs): one tile of rows each (or min_rows_per_program rows, rounded
    up to a multiple of BLOCK_R), or more rows per program for long inputs, so that the row programs
    fit in the grid's second dimension."""
    rows_per_program = triton.cdiv(min_rows_per_program, cfg["BLOCK_R"]) * cfg["BLOCK_R"]
    if triton.cdiv(rows, rows_per_program) > MAX_ROW_PROGRAMS:
        rows_per_program = triton.cdiv(triton.cdiv(rows, MAX_ROW_PROGRAMS), cfg["BLOCK_R"]) * cfg["BLOCK_R"]
    return rows_per_program, max(1, triton.cdiv(rows, rows_per_program))


def triton_swiglu(up: torch.Tensor, gate: torch.Tensor, dh=None, out=None, amax_out=None):
    """Forward (dh None): silu(gate) * up, a new contiguous [rows, cols] tensor in up's dtype.
    Backward: (du, dg) in dh's dtype, written into `out` = (du, dg) when given (two [rows, cols]
    views with one row stride, e.g. the halves of one [rows, 2 cols] buffer), else into two new
    contiguous tensors. up, gate, dh: [rows, cols], any row stride, last-dim stride 1.
    amax_out: a 0-d fp32 tensor to receive the amax of what was written (h, or du and dg)."""
    rows, cols = up.shape
    backward = dh is not None
    if backward:
        du, dg = out if out is not None else (torch.empty(rows, cols, device=up.device, dtype=dh.dtype),
                                              torch.empty(rows, cols, device=up.device, dtype=dh.dtype))
    else:
        du = dg = torch.empty(rows, cols, device=up.device, dtype=up.dtype)
    if du.numel() == 0:
        if amax_out is not None:
            amax_out.zero_()
        return (du, dg) if backward else du
    cfg = LAUNCH[backward] if up.is_cuda else INTERPRET_LAUNCH
    rows_per_program, row_programs = _grid_rows(rows, cfg, 1 if amax_out is None else AMAX_ROWS_PER_PROGRAM)
    grid = (triton.cdiv(cols, cfg["BLOCK_C"]), row_programs)
    partials = None if amax_out is None else torch.empty(grid[0] * grid[1], device=up.device, dtype=torch.float32)
    _swiglu_kernel[grid](
        up, gate, dh, du, dg, partials, rows, cols, up.stride(0), gate.stride(0), dh.stride(0) if backward else 0,
        du.stride(0), rows_per_program, BACKWARD=backward, WITH_AMAX=partials is not None, BLOCK_R=cfg["BLOCK_R"],
        BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["WARPS"])
    if partials is not None:
        torch.amax(partials, dim=0, out=amax_out)  # NaN propagates, as in quantize's amax
    return (du, dg) if backward else du


@triton.jit
def _store_both_layouts(OUT_ROW, OUT_COL, v8, r, r64, c, c64, rows, width, first_col, mask):
    """v8 [BLOCK_R, BLOCK_C] into columns first_col + c of [rows, width] fp8 matrices stored row-major
    (OUT_ROW) and column-major (OUT_COL: a contiguous [width, rows])."""
    tl.store(OUT_ROW + r64[:, None] * width + first_col + c[None, :], v8, mask=mask)
    tl.store(OUT_COL + (c64[None, :] + first_col) * rows + r[:, None], v8, mask=mask)


@triton.jit
def _swiglu_fp8_kernel(UP, GATE, DH, OUT_ROW, OUT_COL, SCALE, HISTORY, RECORD, rows, cols, stride_up, stride_gate,
                       stride_dh, history_count, BACKWARD: tl.constexpr, ROUND_TO: tl.constexpr,
                       FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_A: tl.constexpr):
    # program (row block, column block) of [rows, cols]. Forward: h, [rows, cols] in fp8. Backward:
    # [du | dg], [rows, 2 cols] in fp8. Both row-major at OUT_ROW and column-major at OUT_COL, scaled by
    # the amax history's previous entries, the amax of what is cast max-ed into its current one (RECORD).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    r64, c64 = r.to(tl.int64), c.to(tl.int64)
    quant = _tensor_quant(HISTORY, history_count, True, FP8_MAX, BLOCK_A)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(SCALE, _reciprocal(quant))
    u = tl.load(UP + r64[:, None] * stride_up + c[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + r64[:, None] * stride_gate + c[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    # each value rounded to the dtype the unfused kernel stores it in, then cast as the cast kernel does
    if BACKWARD:
        dh = tl.load(DH + r64[:, None] * stride_dh + c[None, :], mask=mask, other=0.0).to(tl.float32)
        du = (dh * g * s).to(ROUND_TO).to(tl.float32)
        dg = (dh * u * s * (1.0 + g * (1.0 - s))).to(ROUND_TO).to(tl.float32)
        seen = _max_nan(tl.abs(du), tl.abs(dg))
        du8 = _on_fp8_grid(du * quant, FP8_MAX, MANTISSA, MIN_EXP).to(OUT_ROW.dtype.element_ty)
        dg8 = _on_fp8_grid(dg * quant, FP8_MAX, MANTISSA, MIN_EXP).to(OUT_ROW.dtype.element_ty)
        _store_both_layouts(OUT_ROW, OUT_COL, du8, r, r64, c, c64, rows, 2 * cols, 0, mask)
        _store_both_layouts(OUT_ROW, OUT_COL, dg8, r, r64, c, c64, rows, 2 * cols, cols, mask)
    else:
        h = (g * s * u).to(ROUND_TO).to(tl.float32)
        seen = tl.abs(h)
        h8 = _on_fp8_grid(h * quant, FP8_MAX, MANTISSA, MIN_EXP).to(OUT_ROW.dtype.element_ty)
        _store_both_layouts(OUT_ROW, OUT_COL, h8, r, r64, c, c64, rows, cols, 0, mask)
    # |.| >= 0: the integer maximum of the bits is the float one (NaN's bits win too)
    tl.atomic_max(RECORD, tl.reduce(tl.reduce(seen, 1, _max_nan), 0, _max_nan).to(tl.int32, bitcast=True))


# The fp8 passes' tile: 32 x 64, whose column-major stores write 32 contiguous bytes per column. Timed on
# an H200 for the backward of llama-1b's halves [8192, 2816] (three bf16 reads, two fp8 layouts of twice
# the width written): 92 us (2.5 TB/s), against 111 us for the casts' 64 x 64 tile, 102-107 us for 64 x 32
# and 32 x 128, 119-149 us for 128-row or 128-column tiles.
FP8_LAUNCH = {"BLOCK_R": 32, "BLOCK_C": 64, "WARPS": 4}
FP8_INTERPRET_LAUNCH = {"BLOCK_R": 4, "BLOCK_C": 8, "WARPS": 1}
HISTORY_BLOCK = 16  # the amax history is reduced this many entries at a time
_ROUND_TO = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def triton_swiglu_fp8(up: torch.Tensor, gate: torch.Tensor, dh, history: torch.Tensor, dtype: torch.dtype):
    """SwiGLU's output (dh None) or its backward's [du | dg] cast to fp8 `dtype` with delayed scaling:
    (row-major, column-major (strides (1, rows)), 0-d fp32 scale) of [rows, cols] or [rows, 2 cols],
    equal bit for bit to kernels.fp8.cast_delayed(t, dtype, history, row=True, col=True) of what
    triton_swiglu writes (h in up's dtype; du, dg in dh's), whose amax it max-es into history[0].
    up, gate, dh: [rows, cols], any row stride, last-dim stride 1; history: [n] fp32, contiguous."""
    rows, cols = up.shape
    width = cols if dh is None else 2 * cols
    out_row = torch.empty(rows, width, device=up.device, dtype=dtype)
    out_col = torch.empty(width, rows, device=up.device, dtype=dtype).t()
    scale = torch.empty((), device=up.device, dtype=torch.float32)
    cfg = FP8_LAUNCH if up.is_cuda else FP8_INTERPRET_LAUNCH
    fp8_max, mantissa, min_exp = FORMATS[dtype]
    grid = (triton.cdiv(rows, cfg["BLOCK_R"]), triton.cdiv(cols, cfg["BLOCK_C"]))
    _swiglu_fp8_kernel[grid](
        up, gate, dh, out_row, out_col, scale, history[1:], history[:1].view(torch.int32), rows, cols, up.stride(0),
        gate.stride(0), 0 if dh is None else dh.stride(0), history.numel() - 1, BACKWARD=dh is not None,
        ROUND_TO=_ROUND_TO[up.dtype if dh is None else dh.dtype], FP8_MAX=fp8_max, MANTISSA=mantissa,
        MIN_EXP=min_exp, BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_C"], BLOCK_A=HISTORY_BLOCK,
        num_warps=cfg["WARPS"])
    return out_row, out_col, scale
