"""Public act(y + bias) with the bias gradient summed inside the activation's backward."""
from __future__ import annotations

import torch

from . import dispatch
from .reference import ACTIVATION_FUNCTIONS, bias_activation_reference

ACTIVATIONS = tuple(ACTIVATION_FUNCTIONS)


class _TritonBiasActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, activation):
        from .bias_activation_kernel import triton_bias_activation
        y2 = y.reshape(-1, y.shape[-1])
        if y2.stride(-1) != 1:
            y2 = y2.contiguous()
        ctx.save_for_backward(y2, bias)
        ctx.activation, ctx.shape = activation, y.shape
        return triton_bias_activation(y2, bias, activation).view(y.shape)

    @staticmethod
    def backward(ctx, dh):
        from .bias_activation_kernel import triton_bias_activation
        y2, bias = ctx.saved_tensors
        dh2 = dh.reshape(y2.shape)
        if dh2.stride(-1) != 1:
            dh2 = dh2.contiguous()
        dy, dbias = triton_bias_activation(y2, bias, ctx.activation, dh=dh2)
        return dy.view(ctx.shape), dbias.to(bias.dtype), None


def bias_activation(y: torch.Tensor, bias: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """act(y + bias) for y [*, n] and bias [n]: the bias a column-parallel GEMM would otherwise add in
    its epilogue, added here in fp32 instead, so that the backward can sum the bias gradient over
    the rows of dy while it writes dy (one pass over dy instead of two).

    activation: "gelu" (tanh approximation, GPT-2's), "gelu_exact" (erf) or "relu". Computes in
    fp32 and returns y's dtype (a bf16 y under autocast stays bf16; an fp32 bias is not promoted).
    Differentiable in y (gradient in the upstream gradient's dtype) and bias (summed in fp32, then
    the bias's dtype). Triton on CUDA, the reference on CPU (tpflash.kernels.dispatch).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
    if bias.dim() != 1 or bias.shape[0] != y.shape[-1]:
        raise ValueError(f"bias shape {tuple(bias.shape)} must be [{y.shape[-1]}] (the last dim of y {tuple(y.shape)})")
    if dispatch.pick(y) == "triton" and y.is_floating_point() and y.dtype != torch.float64:
        return _TritonBiasActivation.apply(y, bias, activation)
    return bias_activation_reference(y, bias, activation)
