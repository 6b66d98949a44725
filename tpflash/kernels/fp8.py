"""FP8 quantisation with current (per-call) scaling, and the scaled GEMM of two fp8 operands.

    x8, scale = quantize(x, torch.float8_e4m3fn, dim=-1)   # x ~= x8.float() * scale
    y = scaled_mm(a8, scale_a, b8, scale_b, torch.bfloat16)  # (a8 * scale_a) @ (b8 * scale_b)

`dim` is the dimension the amax is taken over, which must be the GEMM's contraction dimension for the
scales to factor out of the sum: dim=-1 of x [M, K] gives one scale per row ([M, 1]; "rowwise"),
dim=0 one per column ([1, K]), dim=None one for the tensor (a 0-d scale; "tensorwise"). The scale
maps the amax to the format's largest value (448 for e4m3, 57344 for e5m2), as torchao's and
Transformer Engine's current scaling do; an all-zero slice gets a tiny amax rather than a zero scale.

`scaled_mm` runs torch._scaled_mm on CUDA (a [M, K] row-major, b [K, N] column-major; rowwise
scales need bf16 output there) and, elsewhere or for shapes it does not take (dims not multiples of
16), the GEMM of the dequantised operands in fp32: the definition the CUDA kernel is tested against.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_AMAX_FLOOR = 1e-12  # torchao's EPS: an all-zero slice quantises to zeros with a finite scale


def amax_of(x: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """fp32 max |x| over `dim` (keepdim; None: the whole tensor, 0-d)."""
    xf = x.float().abs()
    return xf.amax() if dim is None else xf.amax(dim=dim, keepdim=True)


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: Optional[int],
             amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8 in `dtype`, fp32 dequantisation scale): the amax over `dim` (keepdim; None: the whole tensor;
    or the given `amax`, e.g. one reduced over ranks) scaled to the format's largest value, values
    clamped into its range."""
    if dtype not in FP8_MAX:
        raise ValueError(f"fp8 dtype {dtype} must be torch.float8_e4m3fn or torch.float8_e5m2")
    xf = x.float()
    amax = amax_of(xf, dim) if amax is None else amax
    quant = FP8_MAX[dtype] / amax.clamp_min(_AMAX_FLOOR)
    x8 = (xf * quant).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x8, quant.reciprocal()


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values x8 stands for."""
    return x8.float() * scale


def _cuda_shapes_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    m, k = a.shape
    return a.is_cuda and m % 16 == 0 and k % 16 == 0 and b.shape[1] % 16 == 0


def scaled_mm(a8: torch.Tensor, scale_a: torch.Tensor, b8: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a8 * scale_a) @ (b8 * scale_b) in out_dtype: a8 [M, K], b8 [K, N] fp8; scales 0-d (tensorwise),
    or scale_a [M, 1] and scale_b [1, N] (rowwise along K)."""
    if not _cuda_shapes_ok(a8, b8):
        return (dequantize(a8, scale_a) @ dequantize(b8, scale_b)).to(out_dtype)
    rowwise = scale_a.dim() > 0
    gemm_dtype = torch.bfloat16 if rowwise else out_dtype  # rowwise-scaled _scaled_mm writes bf16 only
    a8 = a8 if a8.stride(1) == 1 else a8.contiguous()
    b8 = b8 if b8.stride(0) == 1 else b8.t().contiguous().t()  # column-major, as cuBLASLt's fp8 GEMM needs
    out = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=gemm_dtype)
    return out.to(out_dtype)
