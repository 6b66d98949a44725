"""sum_parts: same-shape tensors added in fp32, in order, and rounded once (checks and dispatch)."""
from __future__ import annotations

from typing import Sequence

import torch

from . import dispatch

MAX_KERNEL_PARTS = 4  # what the Triton kernel takes; more parts are added by torch


def sum_parts(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """parts[0] + parts[1] + ... in fp32, in this order, rounded once to `dtype`: for 2 or more float
    tensors of one shape and device (their dtypes may differ). The bits are those of
    `total = parts[0].float(); total += parts[1]; ...; total.to(dtype)`.

    On the Triton backend, for 2-4 contiguous parts, one kernel (tpflash.kernels.sum_parts_kernel) reads
    every part once and writes the result once; otherwise torch does it as written above. The
    copy-engine reduce-scatter finishes with it at 3-4 ranks (tpflash.parallel.peer_collectives).
    """
    if len(parts) < 2:
        raise ValueError(f"sum_parts takes at least 2 tensors, got {len(parts)}")
    first = parts[0]
    for i, p in enumerate(parts):
        if p.shape != first.shape or p.device != first.device or not p.is_floating_point():
            raise ValueError(f"sum_parts: part {i} is {p.dtype} {tuple(p.shape)} on {p.device}; every part must "
                             f"be a float tensor of shape {tuple(first.shape)} on {first.device}")
    if (len(parts) <= MAX_KERNEL_PARTS and all(p.is_contiguous() for p in parts)
            and dispatch.pick(first) == "triton"):
        from .sum_parts_kernel import triton_sum_parts
        return triton_sum_parts(parts, dtype)
    total = first.to(torch.float32, copy=True)  # never adds into an fp32 parts[0]
    for part in parts[1:]:
        total += part
    return total.to(dtype)
