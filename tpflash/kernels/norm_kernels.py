"""Triton LayerNorm / RMSNorm with fused residual add: forward, backward and autograd.Function.

One flag (RMS) selects RMSNorm (no mean, no bias); one flag (HAS_RESIDUAL) fuses h = x + residual,
whose value is written out as the new residual and normalised in fp32. With a residual, x may come
as up to four parts whose sum it is (PARTS: a reduce-scatter's own and received parts, left unsummed
by the layer that made them), added in fp32, in order, and rounded once to x's dtype (the bits of
tpflash.kernels.sum_parts) before the residual is added: the sum is never written on its own.
Only the first part is differentiable. Forward: one program per
row. Backward: one program per SM, each walking its own rows in tiles of ROWS rows (loads of
several rows in flight, the next tile prefetched when STAGES > 1); programs keep their
dweight/dbias partial sums in fp32 registers, and column_sum_kernel.sum_partials sums them over
programs in one launch (no atomics, deterministic). With a residual of another dtype than x (bf16
branch output, fp32 residual stream), it writes x's gradient in x's dtype beside the residual's, in
the same pass.
The launch is a fixed rule of the shapes and dtypes, not an autotuner: on the H100, different
(ROWS, STAGES) gave gradients that differ in the last bits, and tp ranks that normalise the same
replicated activations must compute the same bits (an autotuner's timing-based pick could differ
between them).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .column_sum_kernel import sum_partials
from .dispatch import interpreting
from .norm import MAX_PARTS


@triton.jit
def _norm_fwd_kernel(X, X1, X2, X3, RES, W, B, Y, RES_OUT, MEAN, RSTD, n, eps, BLOCK: tl.constexpr,
                     RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:  # x = X + X1 (+ X2 + X3), added in fp32 in this order
        h += tl.load(X1 + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 2:
        h += tl.load(X2 + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 3:
        h += tl.load(X3 + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:  # rounded once to x's dtype, as the summed reduce-scatter stores it (kernels.sum_parts' bits)
        h = h.to(X.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:  # the sum is normalised as stored (rounded to the residual's dtype), as the backward sees it
        h += tl.load(RES + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        h = h.to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * n + cols, h, mask=mask)
        h = h.to(tl.float32)
    if RMS:
        centred = h
    else:
        mean = tl.sum(h, 0) / n
        tl.store(MEAN + row, mean)
        centred = tl.where(mask, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / n + eps)
    tl.store(RSTD + row, rstd)
    y = centred * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)


# The backward's launch on a GPU (rows per tile, pipeline stages, warps, programs per SM): a fixed
# rule of the shapes and dtypes (_bwd_launch), not an autotuner: see the module docstring. Chosen
# with benchmarks/tune_norm_bwd.py on an H100 (docs/performance.md, "Memory-bound kernels"): one program per
# SM walking its rows with 3-stage pipelined loads beat 4 programs per SM by 10-40%.
TILE_BYTES = 16 * 1024  # a tile of 2 rows only while it holds at most this many bytes of h
ELEMENTS_PER_WARP = 1024  # warps = tile elements / this (32 per thread), 4 to 16
SMEM_BUDGET = 192 * 1024  # bytes of pipelined loads an H100 program may stage (228 KB per SM)
INTERPRET_BWD = {"ROWS": 2, "STAGES": 2, "WARPS": 1, "PER_SM": None}  # CPU interpreter: 4 programs


@triton.jit
def _norm_bwd_kernel(H, W, DY, DY1, DY2, DY3, DRES, DX, DX_LOW, DW, DB, MEAN, RSTD, rows, n, rows_per_program,
                     partial_stride, BLOCK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr, RMS: tl.constexpr,
                     HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DX_LOW: tl.constexpr,
                     DY_PARTS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_cols = cols < n
    w = tl.load(W + cols, mask=in_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    slot = tl.arange(0, ROWS)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    # ROWS rows per iteration: their loads are in flight together and their row sums share one
    # pass of cross-warp reductions; STAGES > 1 also prefetches the next tile during this one
    for start in tl.range(first, last, ROWS, num_stages=STAGES):
        r = start + slot  # [ROWS]
        in_rows = r < last
        mask = in_rows[:, None] & in_cols[None, :]  # [ROWS, BLOCK]
        at = r.to(tl.int64)[:, None] * n + cols[None, :]
        h = tl.load(H + at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + at, mask=mask, other=0.0).to(tl.float32)
        if DY_PARTS > 1:  # dy = DY + DY1 (+ DY2 + DY3), added in fp32 in this order
            dy += tl.load(DY1 + at, mask=mask, other=0.0).to(tl.float32)
        if DY_PARTS > 2:
            dy += tl.load(DY2 + at, mask=mask, other=0.0).to(tl.float32)
        if DY_PARTS > 3:
            dy += tl.load(DY3 + at, mask=mask, other=0.0).to(tl.float32)
        if DY_PARTS > 1:  # rounded once to dy's dtype, as the summed reduce-scatter stores it (sum_parts' bits)
            dy = dy.to(DY.dtype.element_ty).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=in_rows, other=0.0)[:, None]  # [ROWS, 1]
        if RMS:
            xhat = h * rstd
        else:
            xhat = tl.where(mask, (h - tl.load(MEAN + r, mask=in_rows, other=0.0)[:, None]) * rstd, 0.0)
        # add the tile's rows to dw/db one at a time, in row order, each selected exactly (+0.0
        # elsewhere): the partial sums are the same bits for every ROWS. First, so dy dies sooner.
        for i in tl.static_range(ROWS):
            pick = (in_rows & (slot == i))[:, None]
            dw += tl.sum(tl.where(pick, dy * xhat, 0.0), 0)
            if HAS_BIAS:
                db += tl.sum(tl.where(pick, dy, 0.0), 0)
        wdy = w[None, :] * dy
        c1 = tl.sum(xhat * wdy, 1)[:, None] / n  # [ROWS, 1]
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - xhat * c1 - tl.sum(wdy, 1)[:, None] / n) * rstd
        if HAS_DRES:
            dx += tl.load(DRES + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DX_LOW:  # x's gradient in x's dtype from the same registers: no separate cast pass over dx
            tl.store(DX_LOW + at, dx.to(DX_LOW.dtype.element_ty), mask=mask)
    tl.store(DW + pid * partial_stride + cols, dw, mask=in_cols)
    if HAS_BIAS:
        tl.store(DB + pid * partial_stride + cols, db, mask=in_cols)


def _warps(block: int) -> int:
    """Warps of a forward program for rows of BLOCK columns."""
    return min(max(block // 256, 1), 16)


def _bwd_launch(block: int, tensors: dict, has_dres: bool, dy_parts: int = 1) -> dict:
    """{"ROWS", "STAGES", "WARPS", "PER_SM"} of the backward on a GPU, from BLOCK, the dtypes and how many
    parts dy comes in."""
    h_bytes = tensors["H"].element_size()
    # below 256 columns a warp's lanes no longer all lie along the row for every ROWS, and the row
    # sums would change with ROWS
    rows = 2 if block >= 256 and 2 * block * h_bytes <= TILE_BYTES else 1
    warps = min(max(rows * block // ELEMENTS_PER_WARP, 4), 16)
    loaded = sum(tensors[k].element_size() for k in (["H", "DY", "DRES"] if has_dres else ["H", "DY"]))
    loaded += (dy_parts - 1) * tensors["DY"].element_size()
    stages = 3
    while stages > 1 and stages * rows * block * loaded > SMEM_BUDGET:
        stages -= 1
    return {"ROWS": rows, "STAGES": stages, "WARPS": warps, "PER_SM": 1}


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_shape(n: int):
    block = triton.next_power_of_2(n)
    if block > 65536:
        raise ValueError(f"normalized size {n} exceeds the Triton norm kernel's limit of 65536")
    return block, _warps(block)


def _norm_backward(h, weight, bias, dy, dres, mean, rstd, rms: bool, dx_dtype, launch=None, low_dtype=None,
                   dy_parts=(), low_out=None):
    """(dx [rows, n], dweight, dbias or None, dx_low or None) of the norm of h [rows, n] (contiguous, as
    are dy/dres). dx_low: dx rounded to `low_dtype` (x's dtype under a residual of another dtype, or a
    second copy of dx for x alone), written in the same pass as dx when `low_dtype` is given, into
    `low_out` (contiguous, rows * n elements) where given. dy_parts: up to MAX_PARTS - 1 more
    [rows, n] tensors whose sum with dy is y's gradient (added in fp32 in order, rounded once to dy's
    dtype, inside the kernel).

    Program p owns rows [p * per_program, (p + 1) * per_program) and writes their dweight/dbias sums
    to row p of fp32 [programs, n] buffers, summed here: no atomics, deterministic. `launch`
    (any of "ROWS", "STAGES", "WARPS", "PER_SM") overrides the rule of _bwd_launch (tests,
    benchmarks/tune_norm_bwd.py).
    """
    rows, n = h.shape
    block, _ = _launch_shape(n)
    rule = INTERPRET_BWD if interpreting() else _bwd_launch(block, {"H": h, "DY": dy, "DRES": dres}, dres is not None,
                                                            1 + len(dy_parts))
    launch = dict(rule, **(launch or {}))
    groups = 4 if launch["PER_SM"] is None or h.device.type != "cuda" else launch["PER_SM"] * _sm_count(h.device)
    dx = torch.empty(rows, n, device=h.device, dtype=dx_dtype)
    dx_low = None
    if low_dtype is not None:
        dx_low = torch.empty(rows, n, device=h.device, dtype=low_dtype) if low_out is None else low_out.view(rows, n)
    per_program = max(1, triton.cdiv(rows, groups))
    programs = max(1, triton.cdiv(rows, per_program))
    # dweight's and dbias's partial sums side by side in one [programs, 1 or 2, n] buffer: one sum over
    # programs finishes both
    sums_per_row = 1 if bias is None else 2
    partials = torch.empty(programs, sums_per_row, n, device=h.device, dtype=torch.float32)
    dw, db = partials[:, 0], (None if bias is None else partials[:, 1])
    more_dy = list(dy_parts) + [dy] * (MAX_PARTS - 1 - len(dy_parts))  # unused pointers: any tensor
    args = (h, weight, dy, *more_dy, dres, dx, dx_low, dw, db, mean, rstd, rows, n, per_program, sums_per_row * n)
    flags = dict(BLOCK=block, RMS=rms, HAS_DRES=dres is not None, HAS_BIAS=bias is not None,
                 HAS_DX_LOW=dx_low is not None, DY_PARTS=1 + len(dy_parts))
    _norm_bwd_kernel[(programs,)](*args, **flags, ROWS=launch["ROWS"], STAGES=launch["STAGES"],
                                  num_warps=launch["WARPS"])
    sums = sum_partials(partials.view(programs, sums_per_row * n)).view(sums_per_row, n)
    dbias = sums[1].to(bias.dtype) if bias is not None else None
    return dx, sums[0].to(weight.dtype), dbias, dx_low


class _TritonNorm(torch.autograd.Function):
    """y = norm(x (+ residual)); x's further parts (`more`, with a residual only) are added to x first
    and get no gradient. `grad_ports` more outputs, each shaped like y and holding nothing (a zero-stride
    view), whose gradients the backward adds to y's: a consumer of y that has y's gradient in
    parts returns its first part as y's gradient and the others as the ports' (kernels.layer_norm).
    `x_grad_into` (with a residual): (shape, dtype, device) -> the tensor the backward writes x's
    gradient into, or None (kernels.layer_norm)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, rms, out_dtype, out, grad_ports, x_grad_into, *more):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        parts = [p.reshape(-1, n).contiguous() for p in more]
        res2 = residual.reshape(-1, n).contiguous() if residual is not None else None
        y = torch.empty_like(x2, dtype=out_dtype or x.dtype) if out is None else out.view(rows, n)
        res_out = torch.empty_like(res2) if residual is not None else None
        mean = torch.empty(rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        block, warps = _launch_shape(n)
        extra = parts + [x2] * (MAX_PARTS - 1 - len(parts))  # unused pointers: any tensor
        _norm_fwd_kernel[(rows,)](x2, *extra, res2, weight, bias, y, res_out, mean, rstd, n, eps, BLOCK=block, RMS=rms,
                                  HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
                                  PARTS=1 + len(parts), num_warps=warps)
        ctx.save_for_backward(res_out if residual is not None else x2, weight, bias, mean, rstd)
        ctx.rms, ctx.has_residual, ctx.x_dtype, ctx.more_parts = rms, residual is not None, x.dtype, len(more)
        ctx.shape, ctx.x_grad_into = x.shape, x_grad_into if residual is not None else None
        # a gradient that never comes stays None: no zeros made for an unused residual or port
        ctx.set_materialize_grads(False)
        res_shaped = res_out.reshape(x.shape) if residual is not None else None
        ports = [y.new_empty(()).expand(x.shape) for _ in range(grad_ports)]
        return (y.reshape(x.shape), res_shaped, *ports)

    @staticmethod
    def backward(ctx, dy, dres, *dports):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        n = h.shape[1]
        more = (None,) * ctx.more_parts
        if dy is None and dres is None:  # nothing reached y or the new residual
            return (None,) * (10 + ctx.more_parts)
        dy = torch.zeros_like(h) if dy is None else dy.reshape(-1, n).contiguous()
        dy_parts = [d.reshape(-1, n).contiguous() for d in dports if d is not None]
        has_dres = ctx.has_residual and dres is not None
        dres = dres.reshape(-1, n).contiguous() if has_dres else None
        # with a residual, dx is the residual's gradient (in its dtype, h's) and x's too: when x's dtype
        # differs (bf16 branch output, fp32 residual), or x's gradient has a place of its own
        # (x_grad_into), the kernel also writes it in x's dtype, there
        asked = ctx.x_grad_into is not None and ctx.needs_input_grad[0]  # a place only for a gradient that goes on
        into = ctx.x_grad_into(ctx.shape, ctx.x_dtype, h.device) if asked else None
        x_low = ctx.has_residual and (ctx.x_dtype != h.dtype or into is not None)
        dx, dweight, dbias, dx_low = _norm_backward(h, weight, bias, dy, dres, mean, rstd, ctx.rms,
                                                    h.dtype if ctx.has_residual else ctx.x_dtype,
                                                    low_dtype=ctx.x_dtype if x_low else None, dy_parts=dy_parts,
                                                    low_out=into)
        dx = dx.reshape(ctx.shape)
        rest = (None,) * 6
        if ctx.has_residual:
            return (dx_low.reshape(ctx.shape) if x_low else dx, dweight, dbias, dx) + rest + more
        return (dx, dweight, dbias, None) + rest + more


def triton_norm(x, weight, bias, eps: float, residual, rms: bool, out_dtype=None, more=(), out=None,
                grad_ports: int = 0, x_grad_into=None):
    """(y, new_residual or None, *ports) from the Triton kernels; see tpflash.kernels.layer_norm. `more`:
    x's further parts (with a residual; up to MAX_PARTS in all), added to x first, given no gradient.
    `out`: a contiguous tensor of x's shape and y's dtype that y is written into (y is a view of it).
    grad_ports (up to MAX_PARTS - 1): outputs whose gradients are further parts of y's (_TritonNorm).
    x_grad_into: where x's gradient is written (_TritonNorm)."""
    if more and (residual is None or len(more) >= MAX_PARTS):
        raise ValueError(f"triton_norm: x's further parts need a residual and at most {MAX_PARTS} parts in all "
                         f"(got {1 + len(more)}, residual={'given' if residual is not None else 'None'})")
    return _TritonNorm.apply(x, weight, bias, residual, eps, rms, out_dtype, out, grad_ports, x_grad_into, *more)
