"""Public SwiGLU, silu(gate) * up, whose backward hands the stacked up|gate GEMM its gradient in one buffer.

The gated MLP computes up and gate in one GEMM ([*, 2n], split in two views). Its backward needs the
gradient of that product as one [*, 2n] matrix; when up and gate are such adjacent halves, the
backward here writes d_up and d_gate as the two halves of one new [*, 2n] buffer, so the GEMM's
backward can use it as it is (tpflash.kernels.column_sum.joined_column_blocks finds it) instead of
concatenating two tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import dispatch
from .column_sum import joined_column_blocks
from .fp8 import Fp8Cast, Fp8Handoff, amax_of, cast_delayed
from .reference import swiglu_reference


class _TritonSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, up, gate, amaxes, grad_fp8, out_fp8):
        from .swiglu_kernel import triton_swiglu, triton_swiglu_fp8
        n = up.shape[-1]
        ctx.save_for_backward(up, gate)  # as given: the GEMM's halves stay views, no copy
        # ctx attributes, not saved tensors: under activation checkpointing the saved tensors are
        # recomputed ones, while the GEMM whose backward reads this amax (or gradient) holds the original
        ctx.grad_amax = None if amaxes is None else amaxes[1]
        ctx.grad_fp8 = grad_fp8
        up2, gate2 = up.reshape(-1, n), gate.reshape(-1, n)
        if out_fp8 is not None:  # h in fp8 for the GEMM; what is returned only carries h's gradient
            out_fp8.cast = Fp8Cast(*triton_swiglu_fp8(up2, gate2, None, out_fp8.history, out_fp8.dtype))
            return up.new_zeros(()).expand(up.shape)
        return triton_swiglu(up2, gate2, amax_out=None if amaxes is None else amaxes[0]).view(up.shape)

    @staticmethod
    def backward(ctx, dh):
        from .swiglu_kernel import triton_swiglu
        up, gate = ctx.saved_tensors
        n = up.shape[-1]
        dh2 = dh.reshape(-1, n)
        if dh2.stride(-1) != 1:
            dh2 = dh2.contiguous()
        up2, gate2 = up.reshape(-1, n), gate.reshape(-1, n)
        if ctx.grad_fp8 is not None:  # [d_up | d_gate] cast for the GEMM's backward; none in the compute dtype
            from .swiglu_kernel import triton_swiglu_fp8
            handoff = ctx.grad_fp8
            handoff.cast = Fp8Cast(*triton_swiglu_fp8(up2, gate2, dh2, handoff.history, handoff.dtype))
            return None, None, None, None, None
        if joined_column_blocks([up, gate]) is not None:
            # [d_up | d_gate] as one contiguous [*, 2n] buffer: the stacked GEMM's gradient as it is
            buf = torch.empty(up.shape[:-1] + (2 * n,), device=dh.device, dtype=dh.dtype)
            d_up, d_gate = buf[..., :n], buf[..., n:]
            triton_swiglu(up2, gate2, dh2, out=(d_up.view(-1, n), d_gate.view(-1, n)), amax_out=ctx.grad_amax)
        else:
            d_up, d_gate = (g.view(up.shape) for g in triton_swiglu(up2, gate2, dh2, amax_out=ctx.grad_amax))
        return d_up, d_gate, None, None, None


class _CastGradients(torch.autograd.Function):
    """Identity on (up, gate) whose backward casts [d_up | d_gate] with delayed scaling and hands it to
    the GEMM through grad_fp8 (returning no gradient): the reference path's swiglu(..., grad_fp8=)."""

    @staticmethod
    def forward(ctx, up, gate, grad_fp8):
        ctx.grad_fp8 = grad_fp8
        return up.view_as(up), gate.view_as(gate)

    @staticmethod
    def backward(ctx, d_up, d_gate):
        n, handoff = d_up.shape[-1], ctx.grad_fp8
        joined = torch.cat([d_up.reshape(-1, n), d_gate.reshape(-1, n)], dim=1)  # [rows, 2n]
        handoff.cast = cast_delayed(joined, handoff.dtype, handoff.history, row=True, col=True)
        return None, None, None


class _AmaxOfGradients(torch.autograd.Function):
    """Identity on (up, gate) whose backward writes the amax of their gradients into grad_amax: the
    reference path's way of filling swiglu's `amaxes[1]`."""

    @staticmethod
    def forward(ctx, up, gate, grad_amax):
        ctx.grad_amax = grad_amax  # an attribute, as in _TritonSwiGLU
        return up.view_as(up), gate.view_as(gate)

    @staticmethod
    def backward(ctx, d_up, d_gate):
        ctx.grad_amax.copy_(torch.maximum(amax_of(d_up, None), amax_of(d_gate, None)))
        return d_up, d_gate, None


def swiglu(up: torch.Tensor, gate: torch.Tensor, amaxes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
           grad_fp8: Optional[Fp8Handoff] = None, out_fp8: Optional[Fp8Handoff] = None) -> torch.Tensor:
    """silu(gate) * up (silu(g) = g * sigmoid(g)), the gated MLP's activation: up and gate [*, n] of
    one shape, dtype and device, each with last-dim stride 1 and any other strides (typically the two
    column halves of one [*, 2n] GEMM output) -> a new contiguous [*, n] tensor. Computes in fp32 and
    returns up's dtype; the gradients come in the upstream gradient's dtype.

    Triton on CUDA (tpflash.kernels.swiglu_kernel: one pass over the inputs each way), the reference
    on CPU (tpflash.kernels.dispatch). On the Triton path, when up and gate are adjacent column blocks
    of one contiguous [*, 2n] tensor, [up | gate] (column_sum.joined_column_blocks), the gradients
    come back as the two halves [..., :n], [..., n:] of one new contiguous [*, 2n] buffer, which the
    GEMM's backward can take without torch.cat; otherwise as two contiguous tensors.

    amaxes (fp8 tensorwise GEMMs on either side): two 0-d fp32 tensors, (h_amax, grad_amax). The
    forward writes max |h| into h_amax, the backward the max |.| of d_up and d_gate into grad_amax
    before returning them: on the Triton path in the same passes that write those tensors, so the
    GEMMs' fp8 casts need not read them once more for their scales (NaN propagates, as in quantize).

    grad_fp8 (fp8 delayed scaling; up and gate the halves of one [*, 2n] GEMM output): the backward
    casts [d_up | d_gate] [rows, 2n] to grad_fp8.dtype with the scale from grad_fp8.history
    (kernels.fp8.cast_delayed, bit for bit) and hands it to the GEMM's backward through grad_fp8
    instead of returning gradients: on the Triton path in the pass that computes them, so the
    compute-dtype gradient is never written.

    out_fp8 (fp8 delayed scaling, for the GEMM that multiplies h): the forward casts h to
    out_fp8.dtype with the scale from out_fp8.history (cast_delayed of the h swiglu returns otherwise,
    bit for bit) and hands it over through out_fp8. On the Triton path h is then written only in fp8,
    and the tensor returned is a zero-stride stand-in of h's shape and dtype whose values are not h's:
    it carries h's gradient back, and only a GEMM that takes out_fp8's cast may consume it.
    """
    if up.dim() == 0 or up.shape != gate.shape:
        raise ValueError(f"swiglu: up {tuple(up.shape)} and gate {tuple(gate.shape)} must be [*, n] of one shape")
    if up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"swiglu: up is {up.dtype} on {up.device}, gate {gate.dtype} on {gate.device}; "
                         "they must match")
    for name, t in (("up", up), ("gate", gate)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:  # the kernel steps through columns one element at a time
            raise ValueError(f"swiglu: {name} {tuple(t.shape)} has strides {t.stride()}; "
                             "its last dim must have stride 1")
    if amaxes is not None and (len(amaxes) != 2 or any(
            a.shape != () or a.dtype != torch.float32 or a.device != up.device for a in amaxes)):
        raise ValueError("swiglu: amaxes must be two 0-d float32 tensors on up's device, got "
                         f"{[(tuple(a.shape), a.dtype, str(a.device)) for a in amaxes]}")
    if grad_fp8 is not None and (amaxes is not None or joined_column_blocks([up, gate]) is None):
        raise ValueError("swiglu: grad_fp8 needs up and gate as the two halves of one [*, 2n] tensor, and no amaxes")
    if out_fp8 is not None and amaxes is not None:
        raise ValueError("swiglu: out_fp8 (delayed scaling) and amaxes (tensorwise) exclude each other")
    if dispatch.pick(up) == "triton" and up.is_floating_point() and up.dtype != torch.float64:
        return _TritonSwiGLU.apply(up, gate, amaxes, grad_fp8, out_fp8)
    if grad_fp8 is not None:
        up, gate = _CastGradients.apply(up, gate, grad_fp8)
    if amaxes is None:
        h = swiglu_reference(up, gate)
        if out_fp8 is not None:
            out_fp8.cast = cast_delayed(h.detach().reshape(-1, h.shape[-1]), out_fp8.dtype, out_fp8.history, col=True)
        return h
    h_amax, grad_amax = amaxes
    h = swiglu_reference(*_AmaxOfGradients.apply(up, gate, grad_amax))
    h_amax.copy_(amax_of(h.detach(), None))
    return h
