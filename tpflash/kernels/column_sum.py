"""Public fp32 column sum (the bias gradients' reduction over tokens): checks and dispatch."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import dispatch


def column_sum(x: torch.Tensor) -> torch.Tensor:
    """The fp32 sum over the rows of x [rows, cols] (any float dtype): [cols], as
    x.sum(0, dtype=torch.float32) up to summation order.

    On the Triton backend a deterministic kernel (tpflash.kernels.column_sum_kernel) reads x once:
    on an H200, bf16 [8192, 2048] in 14 us against torch's 24 us ([8192, 8192]: 38 against 44 us).
    x with a last-dim stride other than 1 goes to torch (the kernel would read it strided).
    """
    if x.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    if x.is_floating_point() and x.stride(1) == 1 and dispatch.pick(x) == "triton":
        from .column_sum_kernel import triton_column_sum
        return triton_column_sum(x)
    return x.sum(0, dtype=torch.float32)


def joined_column_blocks(parts: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The one contiguous [*, c_1 + ... + c_k] tensor whose consecutive column blocks the parts [*, c_i]
    are, in this order, as a view (no copy); None when they are not. The views y.split(sizes, -1) of
    a contiguous y are such blocks, and then torch.cat(parts, -1) would only copy y: a backward that
    writes its gradients as halves of one buffer (tpflash.kernels.swiglu) spares the stacked GEMM's
    backward that copy. None also for an empty list or no rows."""
    if not parts or parts[0].dim() == 0 or parts[0].shape[:-1].numel() == 0:
        return None
    first, ptr = parts[0], parts[0].data_ptr()
    for t in parts:  # the cheap test first: separate gradients fail it, at the cost of a few calls
        if t.data_ptr() != ptr:
            return None
        ptr += t.shape[-1] * t.element_size()
    shape = first.shape[:-1] + (sum(t.shape[-1] for t in parts),)
    strides = [1] * len(shape)  # the contiguous strides of the joined tensor
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    storage = first.untyped_storage().data_ptr()
    for t in parts:
        if (t.dim() != first.dim() or t.shape[:-1] != first.shape[:-1] or t.dtype != first.dtype
                or t.device != first.device):
            return None
        # a dim of size 1 is never stepped through: its stride is whatever torch left there
        if any(size > 1 and stride != want for size, stride, want in zip(t.shape, t.stride(), strides)):
            return None
        # the storage check too: two separate allocations can lie next to each other by chance
        if t.untyped_storage().data_ptr() != storage:
            return None
    return first.as_strided(shape, strides)  # storage offset: first's


def concat_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts, dim=-1) as a [rows, c_1 + ... + c_k] matrix for parts [*, c_i] with the same
    leading sizes: the parts' own buffer, not a copy, where they are its column blocks already
    (joined_column_blocks). The stacked layers' backward without bias gradients."""
    joined = joined_column_blocks(parts)
    if joined is not None:
        return joined.view(-1, joined.shape[-1])
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts], dim=-1)


def concat_with_column_sum(parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(torch.cat(parts, dim=-1) as a contiguous [rows, sum c_i] matrix, its fp32 column sums [sum c_i])
    for 1-3 float parts of one dtype and device, each [*, c_i] with the same leading sizes (rows =
    their product). The stacked layers' backward: the gradient of their outputs for one GEMM and the
    biases' gradient.

    Parts that are already one buffer's column blocks (joined_column_blocks) are not copied: the
    result is that buffer, and only the column sums are computed.
    On the Triton backend one pass (tpflash.kernels.concat_sum_kernel) reads each part once, through
    its row strides when it is 2-D or 3-D with last-dim stride 1, and writes the result once;
    otherwise torch.cat and a torch sum.
    """
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"concat_with_column_sum takes 1 to 3 parts, got {len(parts)}")
    first = parts[0]
    for i, p in enumerate(parts):
        if p.shape[:-1] != first.shape[:-1] or p.dtype != first.dtype or p.device != first.device:
            raise ValueError(f"concat_with_column_sum: part {i} is {p.dtype} {tuple(p.shape)} on {p.device}; "
                             f"every part must be {first.dtype} on {first.device} with leading sizes "
                             f"{tuple(first.shape[:-1])}")
    total = sum(p.shape[-1] for p in parts)
    joined = joined_column_blocks(parts)
    if joined is not None and first.is_floating_point():
        rows = joined.view(-1, total)
        return rows, column_sum(rows)
    if (first.is_floating_point() and first.dim() in (2, 3) and first.shape[:-1].numel() > 0
            and all(p.stride(-1) == 1 for p in parts) and dispatch.pick(first) == "triton"):
        from .concat_sum_kernel import triton_concat_with_column_sum
        return triton_concat_with_column_sum(parts)
    out = torch.cat(list(parts), dim=-1).reshape(-1, total)
    return out, out.sum(0, dtype=torch.float32)
