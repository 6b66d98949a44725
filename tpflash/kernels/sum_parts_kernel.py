"""Triton sum of 2-4 same-shape tensors, added in fp32 in the given order and written once in the
output dtype (the copy-engine reduce-scatter's last step at 3-4 ranks: this rank's partial sum plus
the parts the other ranks copied here).

One program per BLOCK elements of the flattened tensors: it loads each part's block, adds them in
fp32, part 0 first, and stores the rounded result, so the output has the bits of
`(p0.float() + p1 + ... ).to(dtype)` computed part by part in torch, with one read of every part and
one write in place of torch's upcast copy, fp32 additions and downcast copy.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program: 8 KB of each bf16 part, 16 per thread at 8 warps
WARPS = 8
INTERPRET_BLOCK = 64


@triton.jit
def _sum_parts_kernel(P0, P1, P2, P3, OUT, n, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(P0 + offs, mask=mask).to(tl.float32)
    acc += tl.load(P1 + offs, mask=mask).to(tl.float32)
    if PARTS > 2:
        acc += tl.load(P2 + offs, mask=mask).to(tl.float32)
    if PARTS > 3:
        acc += tl.load(P3 + offs, mask=mask).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def triton_sum_parts(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """sum_parts on the Triton backend: 2-4 contiguous parts of one shape and device (checked by the caller)."""
    out = torch.empty(parts[0].shape, dtype=dtype, device=parts[0].device)
    n = out.numel()
    if n == 0:
        return out
    pointers = list(parts) + [parts[0]] * (4 - len(parts))  # unused slots: never read (PARTS is constexpr)
    block = INTERPRET_BLOCK if parts[0].device.type == "cpu" else BLOCK
    _sum_parts_kernel[(triton.cdiv(n, block),)](*pointers, out, n, PARTS=len(parts), BLOCK=block, num_warps=WARPS)
    return out
