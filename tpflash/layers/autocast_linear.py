"""F.linear for fp32 weights under autocast, with the weight gradient written in fp32 by the GEMM.

Under autocast, F.linear(x, W) multiplies bf16 copies of x and W; its backward computes the weight
gradient in bf16 and a separate cast (ToCopyBackward) converts it to W's fp32 before it is
accumulated: one more pass over every weight gradient, and a rounding to bf16 on the way. Here
the weight-gradient GEMM writes fp32 directly (torch.mm's `out_dtype`, CUDA; elsewhere a GEMM and
a cast) and the bias gradient is summed in fp32. Forward values equal autocast's; gradients equal
them up to that one rounding. Layers call `linear`, which is F.linear outside autocast.

`linears` does the same for several weights that share one input (q/k/v, up/gate) as one GEMM per
direction over the weights stacked into one buffer (the cast to bf16 writes them there, so the
stacking costs no extra pass under autocast). `casts` (every function's optional last argument): a
block's weight casts for this forward (tpflash.layers.weight_casts.PendingCast), whose views the GEMMs
multiply instead of casting the weights themselves. `add_bias` adds a bias after a reduction without
promoting a bf16 activation to fp32.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..kernels import column_sum, concat_with_column_sum
from ..kernels.column_sum import concat_rows
from ..kernels.weight_grad import weight_grad_fp32
from .fp8_linear import Fp8Amaxes, fp8_linears
from .main_grads import main_grad_of
from .weight_casts import PendingCast, stacked_cast


class _StackedLinear(torch.autograd.Function):
    """[x W_i^T + b_i] for n weights sharing the input x, as ONE GEMM per direction over the weights
    stacked by rows, in `dtype`: x [*, in], W_i [out_i, in] -> (y_1 [*, out_1], ..., y_n) (views of
    one [*, sum out_i] product). Weight and bias gradients come out in fp32 (then the parameters'
    dtype), the input gradient in x's dtype. Biases: all present or all None. casts: a block's
    PendingCast, or None."""

    @staticmethod
    def forward(ctx, x, dtype, casts, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.x_dtype, ctx.sizes = x.dtype, [w.shape[0] for w in weights]
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.main_grad = main_grad_of(weights)  # where the weight gradient is added (tpflash.layers.main_grads)
        with torch.autocast(x.device.type, enabled=False):
            x_c, w_c = x.to(dtype), stacked_cast(weights, dtype, casts)  # w_c [sum out, in]
            b_c = None if biases[0] is None else stacked_cast(biases, dtype, casts)
            y = F.linear(x_c, w_c, b_c)  # [*, sum out]
        ctx.save_for_backward(x_c, w_c)
        return tuple(y.split(ctx.sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grad_ys):
        x_c, w_c = ctx.saved_tensors
        grad_ys = [torch.zeros(x_c.shape[:-1] + (size,), dtype=w_c.dtype, device=w_c.device) if g is None
                   else g.to(w_c.dtype) for g, size in zip(grad_ys, ctx.sizes)]
        n = len(ctx.sizes)
        bias_sums = None
        if n > 1 and ctx.param_dtypes[n] is not None and any(ctx.needs_input_grad[4 + n:]):
            rows, bias_sums = concat_with_column_sum(grad_ys)  # [tokens, sum out] and its column sums, one pass
            grad_y = rows.view(x_c.shape[:-1] + (rows.shape[-1],))
        else:  # no copy where the gradients are one buffer's blocks already (swiglu's backward)
            rows = grad_ys[0].reshape(-1, ctx.sizes[0]) if n == 1 else concat_rows(grad_ys)  # [tokens, sum out]
            grad_y = grad_ys[0] if n == 1 else rows.view(x_c.shape[:-1] + (rows.shape[-1],))  # [*, sum out]
        grad_x, grads = None, [None] * (2 * n)
        if ctx.needs_input_grad[0]:
            grad_x = (grad_y @ w_c).to(ctx.x_dtype)  # [*, in]
        if any(ctx.needs_input_grad[4:4 + n]):
            x2d = x_c.reshape(-1, x_c.shape[-1])
            if ctx.main_grad is not None:  # added into the weights' main_grad; none returned
                weight_grad_fp32(rows, x2d, into=ctx.main_grad)
            elif all(dt == w_c.dtype for dt in ctx.param_dtypes[:n]):  # e.g. FSDP's bf16 weights: no fp32 pass to cast
                grads[:n] = torch.mm(rows.t(), x2d).split(ctx.sizes)  # fp32 accumulation, rounded once, as the cast
            else:
                grads[:n] = weight_grad_fp32(rows, x2d).split(ctx.sizes)
        if ctx.param_dtypes[n] is not None and any(ctx.needs_input_grad[4 + n:]):
            grads[n:] = (column_sum(rows) if bias_sums is None else bias_sums).split(ctx.sizes)
        grads = [None if g is None else g.to(dt) for g, dt in zip(grads, ctx.param_dtypes)]
        return (grad_x, None, None, None, *grads)


def _compute_dtype(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
    """The autocast dtype when F.linear would run under autocast with fp32 weights needing gradients
    (the case where `linear` improves on it), else None."""
    device = x.device.type
    if (device in ("cuda", "cpu") and torch.is_autocast_enabled(device) and torch.is_grad_enabled()
            and x.dtype != torch.float64 and all(w.dtype == torch.float32 and w.requires_grad for w in weights)):
        return torch.get_autocast_dtype(device)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           fp8: str = "off", fp8_amaxes: Optional[Fp8Amaxes] = None,
           casts: Optional[PendingCast] = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [*, in], weight [out, in] -> [*, out]. Under autocast with fp32
    weights that need gradients, the GEMMs run in the autocast dtype as F.linear's would, and the
    weight and bias gradients come out in fp32 without a separate cast (module docstring).
    fp8 "rowwise" / "tensorwise": the GEMMs in fp8 (tpflash.layers.fp8_linear), with fp8_amaxes
    from the neighbouring kernels where they give them."""
    if fp8 != "off":
        return fp8_linears(x, [weight], [bias], fp8, amaxes=fp8_amaxes)[0]
    dtype = _compute_dtype(x, [weight])
    if dtype is None and main_grad_of([weight]) is None:
        return F.linear(x, weight, bias)
    # also outside autocast where the weight has a main_grad: its gradient GEMM adds into it
    return _StackedLinear.apply(x, dtype or x.dtype, casts, 1, weight, bias)[0]


def linears(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
            fp8: str = "off", fp8_amaxes: Optional[Fp8Amaxes] = None,
            casts: Optional[PendingCast] = None) -> List[torch.Tensor]:
    """[F.linear(x, W_i, b_i)] for weights sharing the input x (q/k/v, up/gate): x [*, in],
    W_i [out_i, in] -> [*, out_i] each. While gradients are on, the weights are stacked (cast into
    one buffer; where `casts` holds them, a view of its buffer) and multiplied in one GEMM
    per direction: one wider GEMM runs closer to peak than n narrow ones, and x's gradient comes
    out of one GEMM instead of n GEMMs and n-1 additions.
    Without gradients (inference) the n GEMMs run as they are, and no weights are copied.
    fp8 "rowwise" / "tensorwise": the stacked GEMMs in fp8 (tpflash.layers.fp8_linear), with fp8_amaxes
    (for the stacked outputs) from the neighbouring kernels where they give them."""
    if len(weights) != len(biases):
        raise ValueError(f"linears: {len(weights)} weights but {len(biases)} biases (one per weight, or None)")
    for i, w in enumerate(weights):
        if w.shape[-1] != x.shape[-1]:
            raise ValueError(f"linears: weight {i} has shape {tuple(w.shape)}, but the input's last dim is "
                             f"{x.shape[-1]}: every weight must be [out_i, {x.shape[-1]}]")
    if len(weights) == 1:
        return [linear(x, weights[0], biases[0], fp8, fp8_amaxes, casts)]
    some_biases = any(b is not None for b in biases) and not all(b is not None for b in biases)
    if not torch.is_grad_enabled() or some_biases:
        return [linear(x, w, b, fp8, fp8_amaxes, casts) for w, b in zip(weights, biases)]
    if fp8 != "off":
        return fp8_linears(x, weights, biases, fp8, amaxes=fp8_amaxes)
    dtype = _compute_dtype(x, weights) or x.dtype
    return list(_StackedLinear.apply(x, dtype, casts, len(weights), *weights, *biases))


class _AddBias(torch.autograd.Function):
    """y + bias in y's dtype; the bias gradient summed over all rows in fp32, in the bias's dtype."""

    @staticmethod
    def forward(ctx, y, bias, casts):
        ctx.bias_dtype = bias.dtype
        return y + stacked_cast([bias], y.dtype, casts)

    @staticmethod
    def backward(ctx, grad):
        grad_bias = column_sum(grad.reshape(-1, grad.shape[-1])).to(ctx.bias_dtype)
        return grad, grad_bias, None


def add_bias(y: torch.Tensor, bias: Optional[torch.Tensor], casts: Optional[PendingCast] = None) -> torch.Tensor:
    """y [*, out] + bias [out], keeping y's dtype: under autocast a bf16 GEMM output plus an fp32 bias
    stays bf16 (as F.linear's bias epilogue would give) instead of promoting the activation to fp32,
    which would double the bytes of this pass and of everything downstream of it. The bias gradient
    is accumulated in fp32. For biases added after a reduction (RowParallelLinear)."""
    if bias is None:
        return y
    if bias.dtype == y.dtype or not (y.is_floating_point() and torch.is_grad_enabled() and bias.requires_grad):
        return y + bias.to(y.dtype)
    return _AddBias.apply(y, bias, casts)

