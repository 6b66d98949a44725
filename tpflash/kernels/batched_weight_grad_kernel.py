"""The pointer arrays of a cuBLAS batched GEMM (tpflash.kernels.batched_weight_grad), written on the GPU.

cublasGemmBatchedEx reads the addresses of each batch member's matrices from device memory. A copy
from the host would need a synchronisation that CUDA graph capture forbids; this kernel takes the
addresses as its arguments instead, so a captured graph carries them in its kernel node.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .batched_weight_grad import MAX_BATCH


@triton.jit
def _write_pointers_kernel(OUT, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, N: tl.constexpr):
    # OUT [3, N] int64: row 0 the A matrices' addresses, row 1 the B's, row 2 the C's
    tl.store(OUT + 0, a0)
    tl.store(OUT + N, b0)
    tl.store(OUT + 2 * N, c0)
    tl.store(OUT + 1, a1)
    tl.store(OUT + N + 1, b1)
    tl.store(OUT + 2 * N + 1, c1)
    if N > 2:
        tl.store(OUT + 2, a2)
        tl.store(OUT + N + 2, b2)
        tl.store(OUT + 2 * N + 2, c2)
    if N > 3:
        tl.store(OUT + 3, a3)
        tl.store(OUT + N + 3, b3)
        tl.store(OUT + 2 * N + 3, c3)


def write_pointers(matrices: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """[3, n] int64 on device: the addresses of matrices[0] (the A's), [1] (the B's) and [2] (the C's),
    n = 2..MAX_BATCH of each."""
    n = len(matrices[0])
    if not 2 <= n <= MAX_BATCH or any(len(row) != n for row in matrices) or len(matrices) != 3:
        raise ValueError(f"write_pointers: three rows of 2 to {MAX_BATCH} matrices, got {[len(r) for r in matrices]}")
    out = torch.empty((3, n), dtype=torch.int64, device=device)
    args = [[t.data_ptr() for t in row] + [0] * (MAX_BATCH - n) for row in matrices]
    _write_pointers_kernel[(1,)](out, *args[0], *args[1], *args[2], N=n)
    return out
