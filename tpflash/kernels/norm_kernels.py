"""Triton LayerNorm / RMSNorm with fused residual add: forward, backward and autograd.Function.

One flag (RMS) selects RMSNorm (no mean, no bias); one flag (HAS_RESIDUAL) fuses h = x + residual,
whose value is written out as the new residual and normalised in fp32. Forward: one program per
row. Backward: a fixed number of programs walk the rows, keep dweight/dbias partial sums in fp32
registers, and a final torch sum over programs reduces them (no atomics, deterministic).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .dispatch import interpreting


@triton.jit
def _norm_fwd_kernel(X, RES, W, B, Y, RES_OUT, MEAN, RSTD, n, eps, BLOCK: tl.constexpr, RMS: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(RES + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(RES_OUT + row * n + cols, h.to(RES_OUT.dtype.element_ty), mask=mask)
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


@triton.jit
def _norm_bwd_kernel(H, W, DY, DRES, DX, DW, DB, MEAN, RSTD, rows, n, rows_per_program, BLOCK: tl.constexpr,
                     RMS: tl.constexpr, HAS_DRES: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = (first + i).to(tl.int64)
        if row < rows:
            h = tl.load(H + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            if RMS:
                xhat = h * rstd
            else:
                xhat = tl.where(mask, (h - tl.load(MEAN + row)) * rstd, 0.0)
            wdy = w * dy
            dw += dy * xhat
            if HAS_BIAS:
                db += dy
            c1 = tl.sum(xhat * wdy, 0) / n
            if RMS:
                dx = (wdy - xhat * c1) * rstd
            else:
                dx = (wdy - xhat * c1 - tl.sum(wdy, 0) / n) * rstd
            if HAS_DRES:
                dx += tl.load(DRES + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * n + cols, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW + pid * n + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + pid * n + cols, db, mask=mask)


@functools.lru_cache(maxsize=None)
def _backward_programs(device: torch.device) -> int:
    """Programs of the backward: a few per SM on a GPU, 4 under the interpreter."""
    if interpreting() or device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _launch_shape(n: int):
    block = triton.next_power_of_2(n)
    if block > 65536:
        raise ValueError(f"normalized size {n} exceeds the Triton norm kernel's limit of 65536")
    return block, min(max(block // 256, 1), 16)


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, rms):
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        res2 = residual.reshape(-1, n).contiguous() if residual is not None else None
        y = torch.empty_like(x2)
        res_out = torch.empty_like(res2) if residual is not None else None
        mean = torch.empty(rows, device=x.device, dtype=torch.float32)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        block, warps = _launch_shape(n)
        _norm_fwd_kernel[(rows,)](x2, res2, weight, bias, y, res_out, mean, rstd, n, eps, BLOCK=block, RMS=rms,
                                  HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, num_warps=warps)
        ctx.save_for_backward(res_out if residual is not None else x2, weight, bias, mean, rstd)
        ctx.rms, ctx.has_residual, ctx.x_dtype = rms, residual is not None, x.dtype
        ctx.shape = x.shape
        res_shaped = res_out.reshape(x.shape) if residual is not None else None
        return y.reshape(x.shape), res_shaped

    @staticmethod
    def backward(ctx, dy, dres):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        rows, n = h.shape
        dy = dy.reshape(-1, n).contiguous()
        has_dres = ctx.has_residual and dres is not None
        dres = dres.reshape(-1, n).contiguous() if has_dres else None
        dx = torch.empty(rows, n, device=h.device, dtype=h.dtype if ctx.has_residual else ctx.x_dtype)
        per_program = max(1, triton.cdiv(rows, _backward_programs(h.device)))
        programs = max(1, triton.cdiv(rows, per_program))
        dw = torch.empty(programs, n, device=h.device, dtype=torch.float32)
        db = torch.empty(programs, n, device=h.device, dtype=torch.float32) if bias is not None else None
        block, warps = _launch_shape(n)
        _norm_bwd_kernel[(programs,)](h, weight, dy, dres, dx, dw, db, mean, rstd, rows, n, per_program, BLOCK=block,
                                      RMS=ctx.rms, HAS_DRES=has_dres, HAS_BIAS=bias is not None, num_warps=warps)
        dx = dx.reshape(ctx.shape)
        dweight = dw.sum(0).to(weight.dtype)
        dbias = db.sum(0).to(bias.dtype) if bias is not None else None
        if ctx.has_residual:
            return dx.to(ctx.x_dtype), dweight, dbias, dx, None, None
        return dx, dweight, dbias, None, None, None


def triton_norm(x, weight, bias, eps: float, residual, rms: bool):
    """(y, new_residual or None) from the Triton kernels; see tpflash.kernels.layer_norm."""
    return _TritonNorm.apply(x, weight, bias, residual, eps, rms)
