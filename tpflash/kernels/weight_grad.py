"""A weight gradient grad_y^T x written in fp32 by the GEMM itself, from bf16/fp16 operands.

Autocast's F.linear computes a weight gradient in bf16 and casts it to the fp32 parameter's dtype
afterwards: one more pass over the gradient, and a rounding to bf16 on the way. torch.mm's
`out_dtype` (CUDA, recent torch) lets cuBLAS write the fp32 accumulator directly, and addmm's adds
it to an fp32 gradient that is being summed block by block (row pieces, token chunks) without
rounding in between. Where those overloads are missing, CPU multiplies fp32 copies (the same sums,
so CPU tests see GPU numerics) and an older torch on CUDA a GEMM and a cast.
"""
from __future__ import annotations

from typing import Optional

import torch

_MM_OUT_DTYPE = [None]  # whether torch.mm(..., out_dtype=) works here; found on first use
_ADDMM_OUT_DTYPE = [None]  # the same for torch.addmm(..., out_dtype=, out=)
_MM_DTYPE_OUT = [None]  # the same for torch.mm(..., out_dtype=, out=)


def weight_grad_fp32(grad_y: torch.Tensor, x: torch.Tensor, into: Optional[torch.Tensor] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """grad_y^T x in fp32: grad_y [rows, out], x [rows, in] -> [out, in]; added in place to `into`
    (fp32 [out, in]) when given, so that a weight gradient can be summed over row blocks GEMM by GEMM;
    written into `out` (fp32 [out, in]) when given, e.g. a gradient already handed to autograd
    (tpflash.parallel.held_work)."""
    if into is not None and out is not None:
        raise ValueError("weight_grad_fp32: give `into` (add) or `out` (overwrite), not both")
    if grad_y.dtype == torch.float32:
        if out is not None:
            return torch.mm(grad_y.t(), x, out=out)
        return torch.mm(grad_y.t(), x) if into is None else into.addmm_(grad_y.t(), x)
    flag = _MM_DTYPE_OUT if out is not None else _MM_OUT_DTYPE if into is None else _ADDMM_OUT_DTYPE
    if flag[0] is not False and grad_y.is_cuda:
        try:
            if out is not None:
                result = torch.mm(grad_y.t(), x, out_dtype=torch.float32, out=out)
            elif into is None:
                result = torch.mm(grad_y.t(), x, out_dtype=torch.float32)
            else:
                result = torch.addmm(into, grad_y.t(), x, out_dtype=torch.float32, out=into)
            flag[0] = True
            return result
        except torch.OutOfMemoryError:  # a real failure, not a missing overload
            raise
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm.dtype for these inputs
            flag[0] = False
    if grad_y.is_cuda:  # an older torch: the GEMM in the operands' dtype, then the cast
        product = torch.mm(grad_y.t(), x).float()
    else:  # CPU has no out_dtype GEMM; an fp32 one gives the same sums as the GPU's fp32 accumulator
        product = torch.mm(grad_y.t().float(), x.float())
    if out is not None:
        return out.copy_(product)
    return product if into is None else into.add_(product)
