"""Fused kernels (Triton on CUDA), each beside a plain-PyTorch reference. Knows nothing of process groups.

Public kernels: flash_attention, layer_norm, rms_norm, apply_rotary, and the cross-entropy row
kernels used by tpflash.losses. `use_backend("triton"|"reference"|"auto")` or the environment
variable TPFLASH_KERNELS picks the implementation (auto: Triton on CUDA, reference on CPU).
"""
from .attention import flash_attention
from .dispatch import BACKENDS, requested_backend, use_backend
from .fused_dense import FusedDense, FusedDenseGeluDense, fused_dense, fused_dense_gelu_dense  # noqa: F401
from .norm import layer_norm, rms_norm
from .rotary import apply_rotary

__all__ = ["BACKENDS", "apply_rotary", "flash_attention", "layer_norm", "requested_backend", "rms_norm",
           "use_backend"]
