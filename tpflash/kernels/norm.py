"""Public LayerNorm / RMSNorm with an optional fused residual add: checks and dispatch."""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch
from .reference import layer_norm_reference, rms_norm_reference


def _check_norm_inputs(x, weight, bias, residual) -> None:
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight shape {tuple(weight.shape)} must be [{n}] (the last dim of x {tuple(x.shape)})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be [{n}]")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")


def _norm(x, weight, bias, eps, residual, rms: bool, out_dtype: Optional[torch.dtype]):
    _check_norm_inputs(x, weight, bias, residual)
    if dispatch.pick(x) == "triton":
        from .norm_kernels import triton_norm
        y, new_residual = triton_norm(x, weight, bias, eps, residual, rms, out_dtype)
        return y if residual is None else (y, new_residual)
    out = rms_norm_reference(x, weight, eps, residual) if rms else layer_norm_reference(x, weight, bias, eps, residual)
    if out_dtype is None:
        return out
    return out.to(out_dtype) if residual is None else (out[0].to(out_dtype), out[1])


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
               residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None):
    """LayerNorm over the last dim of x [..., n] with fp32 statistics; weight/bias [n].

    Returns y (x's dtype, or `out_dtype`: the fp32 result rounded once, as a later cast would), or
    with `residual` (shaped like x) the pair (y, new_residual) where new_residual = x + residual
    (residual's dtype) and y = LayerNorm(new_residual). Differentiable in x, residual, weight and bias.
    """
    return _norm(x, weight, bias, eps, residual, False, out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
             out_dtype: Optional[torch.dtype] = None):
    """RMSNorm x * rsqrt(mean(x^2) + eps) * weight over the last dim, fp32 statistics.

    Same residual and `out_dtype` conventions as `layer_norm`: with `residual`, returns
    (RMSNorm(x + residual), x + residual).
    """
    return _norm(x, weight, None, eps, residual, True, out_dtype)
