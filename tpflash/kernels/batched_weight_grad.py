"""Same-shape weight gradients grad_y_i^T x_i, written in fp32, as one cuBLAS batched GEMM.

cuBLAS tiles a weight gradient whose [out, in] is a few tiles wide by one wave of SMs, and the last,
partial wave leaves most SMs idle: gpt-2.7b's up and down projections at tp=4 ([2560 x 2560] over
8,192 rows) each run 192 x 192 tiles, 196 on an H200's 132 SMs, at about 560 TFLOP/s against about
720 at tp=1. Two such gradients in one batched GEMM share their waves: 303-306 us against 394-414
for the two GEMMs (docs/overlap.md, "Costs and limits").

The operands of the gradients lie in separate buffers (a layer's kept input, an activation, a
gathered output gradient), so the batch is given by pointer arrays (`cublasGemmBatchedEx`), which
torch does not expose: it is called through ctypes on torch's own cuBLAS handle (its stream and
workspace), from the libcublas this process has loaded. The pointer arrays are written on the GPU by
a small kernel whose arguments are the addresses (tpflash.kernels.batched_weight_grad_kernel), so the
call is captured by a CUDA graph like any other. cuBLAS's grouped GEMM, which would take gradients of
different shapes, does not take bf16 operands with an fp32 result (CUBLAS_STATUS_NOT_SUPPORTED).
Where the batched call is not possible (CPU, another dtype, no libcublas found), each gradient is
`weight_grad_fp32`.
"""
from __future__ import annotations

import ctypes
import functools
from typing import List, Optional, Sequence

import torch

from .weight_grad import weight_grad_fp32

MAX_BATCH = 4  # gradients per batched call (the pointer kernel's arity)
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_32F = 0
_CUDA_TYPES = {torch.bfloat16: 14, torch.float16: 2}  # cudaDataType of the operands
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1


@functools.lru_cache(maxsize=None)
def _gemm_batched_ex():
    """cublasGemmBatchedEx from the libcublas torch has loaded (the one of torch's CUDA major version,
    whose handles torch hands out, where the process maps several), with its argument types; None where
    none is found."""
    torch.cuda.current_blas_handle()  # loads libcublas
    own = f"/libcublas.so.{(torch.version.cuda or '').split('.')[0]}"
    try:
        with open("/proc/self/maps") as maps:
            mapped = [line.split()[-1] for line in maps if "/libcublas.so" in line]
        path = next((m for m in mapped if m.endswith(own)), mapped[0] if mapped else None)
        if path is None:
            return None
        fn = ctypes.CDLL(path).cublasGemmBatchedEx
    except (OSError, AttributeError):
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i, i]
    fn.restype = i
    return fn


def batched(grad_ys: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> bool:
    """Whether `weight_grads_fp32(grad_ys, xs, ...)` is one batched GEMM here: 2 to MAX_BATCH gradients of
    one shape and layout (rows contiguous), bf16 or fp16 operands on one CUDA device, each starting on
    a 16-byte boundary (cuBLAS's vector loads), and cublasGemmBatchedEx found."""
    first_g, first_x = grad_ys[0], xs[0]
    return (2 <= len(grad_ys) <= MAX_BATCH and first_g.is_cuda and first_g.dtype in _CUDA_TYPES
            and all(t.data_ptr() % 16 == 0 for t in (*grad_ys, *xs))
            and first_g.stride(1) == 1 and first_x.stride(1) == 1
            and all(g.shape == first_g.shape and g.stride() == first_g.stride() and g.dtype == first_g.dtype
                    and g.device == first_g.device for g in grad_ys)
            and all(x.shape == first_x.shape and x.stride() == first_x.stride() and x.dtype == first_g.dtype
                    and x.device == first_g.device for x in xs)
            and _gemm_batched_ex() is not None)


def weight_grads_fp32(grad_ys: Sequence[torch.Tensor], xs: Sequence[torch.Tensor],
                      into: Optional[Sequence[torch.Tensor]] = None,
                      out: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    """[grad_y_i^T x_i in fp32 for each i]: grad_ys [rows, out] and xs [rows, in] of one shape each, the
    results [out, in] added into `into` (fp32, accumulate) or written into `out` (fp32), one of the two
    given; returns those tensors. One batched GEMM where `batched` says so, else `weight_grad_fp32` per
    gradient (which then also takes other shapes)."""
    if (into is None) == (out is None):
        raise ValueError("weight_grads_fp32: give `into` (add) or `out` (overwrite), not both or neither")
    results = list(into if into is not None else out)
    if not (len(grad_ys) == len(xs) == len(results)):
        raise ValueError(f"weight_grads_fp32: {len(grad_ys)} grad_ys, {len(xs)} xs and {len(results)} results")
    rows, n_out, n_in = grad_ys[0].shape[0], grad_ys[0].shape[1], xs[0].shape[1]
    fits = all(r.dtype == torch.float32 and r.shape == (n_out, n_in) and r.is_contiguous() and r.data_ptr() % 16 == 0
               for r in results)
    if not (fits and batched(grad_ys, xs)):
        return [weight_grad_fp32(g, x, into=r if into is not None else None, out=r if out is not None else None)
                for g, x, r in zip(grad_ys, xs, results)]
    from .batched_weight_grad_kernel import write_pointers
    # column-major, as cuBLAS sees row-major tensors: result^T [in, out] = x^T [in, rows] @ grad_y [rows, out]
    pointers = write_pointers([xs, grad_ys, results], grad_ys[0].device)  # [3, n] device addresses
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if into is not None else 0.0)
    dtype = _CUDA_TYPES[grad_ys[0].dtype]
    status = _gemm_batched_ex()(
        torch.cuda.current_blas_handle(), _CUBLAS_OP_N, _CUBLAS_OP_T, n_in, n_out, rows, ctypes.byref(alpha),
        pointers[0].data_ptr(), dtype, xs[0].stride(0), pointers[1].data_ptr(), dtype, grad_ys[0].stride(0),
        ctypes.byref(beta), pointers[2].data_ptr(), _CUDA_R_32F, n_in, len(results), _CUBLAS_COMPUTE_32F,
        _CUBLAS_GEMM_DEFAULT)
    if status != 0:
        raise RuntimeError(f"cublasGemmBatchedEx returned status {status} for {len(results)} weight gradients "
                           f"[{n_out} x {n_in}] over {rows} rows")
    return results
