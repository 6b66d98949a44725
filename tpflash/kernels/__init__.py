"""Fused kernels (Triton on CUDA), each beside a plain-PyTorch reference. Knows nothing of process groups.

Public kernels: flash_attention, layer_norm, rms_norm, apply_rotary, column_sum (and
concat_with_column_sum), bias_activation, swiglu (silu(gate) * up), sum_parts (tensors added in
fp32 and rounded once), the
cross-entropy row kernels used by tpflash.losses, weight_grad_fp32 (a weight gradient written in
fp32 by the GEMM; several of one shape as one cuBLAS batched GEMM: tpflash.kernels.batched_weight_grad),
and fused_dense / fused_dense_gelu_dense (the optional
csrc/ extension). The fp8 casts and scaled GEMM live in tpflash.kernels.fp8 (imported by the fp8 layers). `use_backend("triton"|"reference"|"auto")` or the environment variable
TPFLASH_KERNELS picks the implementation (auto: Triton on CUDA, reference on CPU).
"""
from .attention import flash_attention
from .bias_activation import bias_activation
from .column_sum import column_sum, concat_with_column_sum
from .dispatch import BACKENDS, requested_backend, use_backend
from .fused_dense import FusedDense, FusedDenseGeluDense, fused_dense, fused_dense_gelu_dense
from .norm import layer_norm, rms_norm
from .rotary import apply_rotary
from .sum_parts import sum_parts
from .swiglu import swiglu
from .weight_grad import weight_grad_fp32

__all__ = ["BACKENDS", "FusedDense", "FusedDenseGeluDense", "apply_rotary", "bias_activation", "column_sum",
           "concat_with_column_sum", "flash_attention", "fused_dense", "fused_dense_gelu_dense", "layer_norm",
           "requested_backend", "rms_norm", "sum_parts", "swiglu", "use_backend", "weight_grad_fp32"]
