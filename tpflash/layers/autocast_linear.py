"""F.linear for fp32 weights under autocast, with the weight gradient written in fp32 by the GEMM.

Under autocast, F.linear(x, W) multiplies bf16 copies of x and W; its backward computes the weight
gradient in bf16 and a separate cast (ToCopyBackward) converts it to W's fp32 before it is
accumulated: one more pass over every weight gradient, and a rounding to bf16 on the way. Here
the weight-gradient GEMM writes fp32 directly (torch.mm's `out_dtype`, CUDA; elsewhere a GEMM and
a cast) and the bias gradient is summed in fp32. Forward values equal autocast's; gradients equal
them up to that one rounding. Layers call `linear`, which is F.linear outside autocast.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_MM_OUT_DTYPE = [None]  # whether torch.mm(..., out_dtype=) works here; found on first use


def _weight_grad_fp32(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad_y^T x in fp32: [rows, out]^T [rows, in] -> [out, in]."""
    if _MM_OUT_DTYPE[0] is not False and grad_y.is_cuda:
        try:
            out = torch.mm(grad_y.t(), x, out_dtype=torch.float32)
            _MM_OUT_DTYPE[0] = True
            return out
        except torch.OutOfMemoryError:  # a real failure, not a missing overload
            raise
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm.dtype for these inputs
            _MM_OUT_DTYPE[0] = False
    return torch.mm(grad_y.t(), x).float()


class _AutocastLinear(torch.autograd.Function):
    """y = x W^T + b in `dtype`; gradients of W and b in fp32, of x in x's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.x_dtype, ctx.has_bias = x.dtype, bias is not None
        with torch.autocast(x.device.type, enabled=False):
            x_c, w_c = x.to(dtype), weight.to(dtype)
            y = F.linear(x_c, w_c, None if bias is None else bias.to(dtype))
        ctx.save_for_backward(x_c, w_c)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_c, w_c = ctx.saved_tensors
        grad_y = grad_y.to(w_c.dtype)
        rows = grad_y.reshape(-1, grad_y.shape[-1])  # [tokens, out]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_y @ w_c).to(ctx.x_dtype)  # [*, in]
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad_fp32(rows, x_c.reshape(-1, x_c.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0, dtype=torch.float32)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [*, in], weight [out, in] -> [*, out]. Under autocast with fp32
    weights that need gradients, the GEMMs run in the autocast dtype as F.linear's would, and the
    weight and bias gradients come out in fp32 without a separate cast (module docstring)."""
    device = x.device.type
    if (device in ("cuda", "cpu") and torch.is_autocast_enabled(device) and weight.dtype == torch.float32
            and weight.requires_grad and torch.is_grad_enabled() and x.dtype != torch.float64):
        return _AutocastLinear.apply(x, weight, bias, torch.get_autocast_dtype(device))
    return F.linear(x, weight, bias)
