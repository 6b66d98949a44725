"""Public LayerNorm / RMSNorm with an optional fused residual add: checks and dispatch."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

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


Parts = Union[torch.Tensor, Sequence[torch.Tensor]]  # x, or parts whose sum is x
MAX_PARTS = 4  # the kernels add up to this many parts of x (forward) and of y's gradient (backward)


def _parts_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """parts[0] + parts[1] + ... in fp32 (float64 stays), in order, rounded once to parts[0]'s dtype;
    differentiable in parts[0] only (the kernel's rule)."""
    total = parts[0].to(torch.promote_types(parts[0].dtype, torch.float32))
    for part in parts[1:]:
        total = total + part.detach()
    return total.to(parts[0].dtype)


class _GradPorts(torch.autograd.Function):
    """(y, *ports) from y: `count` ports, each shaped like y and holding nothing (a zero-stride view),
    whose gradients are added to y's in fp32, in order, rounded once to y's gradient's dtype (the
    Triton backward's rule, here as torch ops)."""

    @staticmethod
    def forward(ctx, y, count):
        ctx.set_materialize_grads(False)  # a port whose gradient never comes adds nothing
        return (y.view_as(y), *(y.new_empty(()).expand(y.shape) for _ in range(count)))

    @staticmethod
    def backward(ctx, dy, *dports):
        given = [d for d in dports if d is not None]
        if not given:
            return dy, None
        return _parts_sum([torch.zeros_like(given[0]) if dy is None else dy, *given]), None


class _GradInto(torch.autograd.Function):
    """x, whose gradient the backward writes into `into(shape, dtype, device)` where that gives a tensor
    (kernels.layer_norm's x_grad_into, here as torch ops)."""

    @staticmethod
    def forward(ctx, x, into):
        ctx.into = into
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        place = ctx.into(dx.shape, dx.dtype, dx.device) if dx is not None and ctx.needs_input_grad[0] else None
        return (dx if place is None else place.copy_(dx)), None


def _check_out(out: Optional[torch.Tensor], x: torch.Tensor, y_dtype: torch.dtype) -> None:
    if out is not None and (out.shape != x.shape or out.dtype != y_dtype or out.device != x.device
                            or not out.is_contiguous()):
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} on {out.device} (contiguous: {out.is_contiguous()}); "
                         f"y needs a contiguous {tuple(x.shape)} {y_dtype} tensor on {x.device}")


GradInto = Callable[[torch.Size, torch.dtype, torch.device], Optional[torch.Tensor]]


def _norm(x: Parts, weight, bias, eps, residual, rms: bool, out_dtype: Optional[torch.dtype],
          out: Optional[torch.Tensor] = None, grad_ports: int = 0, x_grad_into: Optional[GradInto] = None):
    if not 0 <= grad_ports < MAX_PARTS:
        raise ValueError(f"grad_ports={grad_ports} must be in [0, {MAX_PARTS - 1}] (the backward adds up to "
                         f"{MAX_PARTS} parts of y's gradient)")
    parts = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    for i, part in enumerate(parts):
        if part.shape != parts[0].shape or part.device != parts[0].device:
            raise ValueError(f"x's part {i} is {tuple(part.shape)} on {part.device}; every part must be "
                             f"{tuple(parts[0].shape)} on {parts[0].device}")
    x = parts[0]
    _check_norm_inputs(x, weight, bias, residual)
    _check_out(out, x, out_dtype or x.dtype)
    if dispatch.pick(x) == "triton":
        from .norm_kernels import triton_norm
        if len(parts) == 1 or (residual is not None and len(parts) <= MAX_PARTS):
            y, new_residual, *ports = triton_norm(x, weight, bias, eps, residual, rms, out_dtype, more=parts[1:],
                                                  out=out, grad_ports=grad_ports, x_grad_into=x_grad_into)
            y = (y, *ports) if grad_ports else y
            return y if residual is None else (y, new_residual)
    if x_grad_into is not None and residual is not None:
        parts = (_GradInto.apply(parts[0], x_grad_into),) + parts[1:]
        x = parts[0]
    if len(parts) > 1:  # the sum as the kernel forms it
        x = _parts_sum(parts)
    y = rms_norm_reference(x, weight, eps, residual) if rms else layer_norm_reference(x, weight, bias, eps, residual)
    y, new_residual = (y, None) if residual is None else y
    if out_dtype is not None:
        y = y.to(out_dtype)
    if out is not None:  # filled as well; y stays a tensor of its own (autograd's)
        out.copy_(y.detach())
    if grad_ports:
        y = _GradPorts.apply(y, grad_ports)
    return y if residual is None else (y, new_residual)


def layer_norm(x: Parts, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
               residual: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               out: Optional[torch.Tensor] = None, grad_ports: int = 0, x_grad_into: Optional[GradInto] = None):
    """LayerNorm over the last dim of x [..., n] with fp32 statistics; weight/bias [n].

    Returns y (x's dtype, or `out_dtype`: the fp32 result rounded once, as a later cast would), or
    with `residual` (shaped like x) the pair (y, new_residual) where new_residual = x + residual
    (residual's dtype) and y = LayerNorm(new_residual). Differentiable in x, residual, weight and bias.
    x may also be a tuple of same-shaped parts whose sum it is (a reduce-scatter's, unsummed: the
    overlapped RowParallelLinear's `output_parts`): they are added in fp32, in order, and rounded
    once to the first part's dtype (tpflash.kernels.sum_parts' bits) inside the kernel (with a
    residual, up to four parts), the sum never written on its own; only the first part gets a
    gradient (the others are other ranks' contributions, whose gradients their ranks compute).
    `out`: a contiguous tensor of x's shape and y's dtype that y is written into, so that y lies where
    its consumer reads it (a column layer's gathered-input buffer: ParallelAttention.input_part); the
    Triton kernels return y as a view of it, the reference path returns a tensor of its own and fills
    out with the same values. ValueError for an out of another shape, dtype or device.
    `grad_ports` (0 to 3): y comes as a tuple (y, *ports), each port shaped like y and holding nothing
    (a zero-stride view), whose gradients the backward adds to y's, in fp32, in order, rounded once
    to y's gradient's dtype (sum_parts' bits), inside the kernel: a consumer whose gradient for y comes
    as parts (a reduce-scatter's, unsummed: the overlapped column layer's input gradient inside a
    CUDA graph capture) returns its first part as y's gradient and the others as the ports', and the
    sum is never written on its own. A port whose gradient never comes adds nothing.
    `x_grad_into` (with a residual; ignored without): a function (shape, dtype, device) -> a contiguous
    tensor, or None, called in the backward; x's gradient (x's first part's) is written into that
    tensor, in the pass that computes it, and is that tensor: where x's producer reads it from (a row
    layer's backward all-gather: tpflash.parallel.overlap_transfers.row_grad_part). None: a tensor of its own.
    """
    return _norm(x, weight, bias, eps, residual, False, out_dtype, out, grad_ports, x_grad_into)


def rms_norm(x: Parts, weight: torch.Tensor, eps: float = 1e-6, residual: Optional[torch.Tensor] = None,
             out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None, grad_ports: int = 0,
             x_grad_into: Optional[GradInto] = None):
    """RMSNorm x * rsqrt(mean(x^2) + eps) * weight over the last dim, fp32 statistics.

    Same residual, parts, `out_dtype`, `out`, `grad_ports` and `x_grad_into` conventions as `layer_norm`:
    with `residual`, returns (RMSNorm(x + residual), x + residual).
    """
    return _norm(x, weight, None, eps, residual, True, out_dtype, out, grad_ports, x_grad_into)
