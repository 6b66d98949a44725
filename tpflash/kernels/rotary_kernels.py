"""Triton rotary embedding (half-split or interleaved pairs), in or out of place, and its backward.

A program rotates BLOCK_H heads at BLOCK_S positions of one batch row: it loads cos/sin of those
positions once and the two halves of each pair as two [BLOCK_S, BLOCK_H, half] tiles. Several
positions per program keep the programs large where the heads are few (k under GQA, a tp rank's
share of the heads): one position per program left a k of one head to thousands of tiny programs.
The backward is the same kernel rotating by the opposite angle (CONJ negates sin).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(X, OUT, COS, SIN, sxb, sxs, sxh, sob, sos, soh, scs, seq, heads, half,
                   BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   INTERLEAVED: tl.constexpr, CONJ: tl.constexpr):
    # one [BLOCK_S positions, BLOCK_H heads, BLOCK_HALF pairs] tile of one batch row
    ss = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    b = tl.program_id(1).to(tl.int64)
    hs = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    s3 = ss.to(tl.int64)[:, None, None]
    h3 = hs[None, :, None]
    i3 = i[None, None, :]
    angle_mask = (ss < seq)[:, None, None] & (i3 < half)
    c = tl.load(COS + s3 * scs + i3, mask=angle_mask, other=1.0).to(tl.float32)  # [BLOCK_S, 1, BLOCK_HALF]
    sn = tl.load(SIN + s3 * scs + i3, mask=angle_mask, other=0.0).to(tl.float32)
    if CONJ:
        sn = -sn
    if INTERLEAVED:
        first, second = 2 * i3, 2 * i3 + 1
    else:
        first, second = i3, i3 + half
    mask = angle_mask & (h3 < heads)
    xrow = X + b * sxb + s3 * sxs + h3 * sxh
    orow = OUT + b * sob + s3 * sos + h3 * soh
    x1 = tl.load(xrow + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(orow + first, (x1 * c - x2 * sn).to(OUT.dtype.element_ty), mask=mask)
    tl.store(orow + second, (x2 * c + x1 * sn).to(OUT.dtype.element_ty), mask=mask)


def _as_4d(t):
    """[batch, seq, heads, dim] view of a [seq, heads, dim] or [batch, seq, heads, dim] tensor."""
    return t.unsqueeze(0) if t.dim() == 3 else t


PAIRS_PER_PROGRAM = 2048  # rotated pairs a program takes: few heads (k under GQA, tp) still fill it


def rotate(x, out, cos, sin, interleaved: bool, conj: bool):
    """Write the rotation of x into out (may be x itself); features past rotary_dim are copied over."""
    x4, o4 = _as_4d(x), _as_4d(out)
    batch, seq, heads, dim = x4.shape
    half = cos.shape[-1]
    cos, sin = cos.contiguous(), sin.contiguous()
    block_half = max(triton.next_power_of_2(half), 2)
    block_h = max(1, min(triton.next_power_of_2(heads), PAIRS_PER_PROGRAM // block_half))
    block_s = max(1, min(triton.next_power_of_2(seq), PAIRS_PER_PROGRAM // (block_h * block_half)))
    grid = (triton.cdiv(seq, block_s), batch, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](x4, o4, cos, sin, *x4.stride()[:3], *o4.stride()[:3], cos.stride(0), seq, heads, half,
                         BLOCK_S=block_s, BLOCK_H=block_h, BLOCK_HALF=block_half, INTERLEAVED=interleaved,
                         CONJ=conj, num_warps=4 if block_s * block_h * block_half >= 1024 else 1)
    if 2 * half < dim and out.data_ptr() != x.data_ptr():
        o4[..., 2 * half:] = x4[..., 2 * half:]
    return out


class _TritonRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, inplace):
        out = x if inplace else torch.empty_like(x)
        rotate(x, out, cos, sin, interleaved, conj=False)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return rotate(grad, torch.empty_like(grad), cos, sin, ctx.interleaved, conj=True), None, None, None, None


def triton_rotary(x, cos, sin, interleaved: bool, inplace: bool):
    """Rotary embedding through the Triton kernel; see tpflash.kernels.apply_rotary."""
    if x.dim() > 4:  # fold the extra leading dims into the batch
        if inplace:
            raise ValueError(f"inplace rotary needs x of 3 or 4 dims, got shape {tuple(x.shape)}")
        return _TritonRotary.apply(x.reshape(-1, *x.shape[-3:]), cos, sin, interleaved, False).reshape(x.shape)
    return _TritonRotary.apply(x, cos, sin, interleaved, inplace)
