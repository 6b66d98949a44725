"""copy_owned_rows: the rows of a batch of tokens whose ids one rank's vocabulary shard holds, copied
from a table (or a gradient) into place (checks and dispatch).

The vocabulary-parallel embedding's exchange through peers' memory (tpflash.parallel.peer_embedding)
is made of it: in the forward each rank writes the table rows of the tokens it owns straight into the
buffer of the rank that holds those tokens' positions; in the backward each rank reads the gradient
rows of the tokens it owns from the ranks that hold their positions.
"""
from __future__ import annotations

import torch

from . import dispatch

ZERO_NONE, ZERO_INVALID, ZERO_UNOWNED = 0, 1, 2  # which rows that are not copied get zeros


def copy_owned_rows(ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lo: int, hi: int, *,
                    lookup: bool, zero: int = ZERO_NONE, valid_hi: int = 0) -> None:
    """For every i with lo <= ids[i] < hi: dst[i] = src[ids[i] - lo] (lookup=True: src is a table shard
    [hi - lo, dim]) or src[i] (lookup=False: src is [n, dim] like dst). Other rows of dst: left as they
    are (zero=ZERO_NONE), zeroed where ids[i] is outside [0, valid_hi) (ZERO_INVALID: ids no rank
    owns), or zeroed (ZERO_UNOWNED). ids [n] integer; src and dst contiguous, dst [n, dim], of one
    dtype. dst and src may be views of a peer's memory (CUDA): the Triton kernel then reads or writes
    across NVLink, and only the rows it copies (or zeroes) travel.
    """
    if ids.dim() != 1 or dst.dim() != 2 or dst.shape[0] != ids.shape[0]:
        raise ValueError(f"copy_owned_rows: ids {tuple(ids.shape)} and dst {tuple(dst.shape)} must be [n] and [n, dim]")
    if src.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype or (not lookup and src.shape != dst.shape):
        raise ValueError(f"copy_owned_rows: src {src.dtype} {tuple(src.shape)} does not fit dst {dst.dtype} "
                         f"{tuple(dst.shape)} (lookup={lookup})")
    if lookup and src.shape[0] != hi - lo:
        raise ValueError(f"copy_owned_rows: a table shard of {src.shape[0]} rows for ids [{lo}, {hi})")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_owned_rows: src and dst must be contiguous")
    if ids.numel() == 0:
        return
    if dispatch.pick(dst) == "triton":
        from .owned_rows_kernel import triton_copy_owned_rows
        triton_copy_owned_rows(ids, src, dst, lo, hi, lookup, zero, valid_hi)
        return
    owned = (ids >= lo) & (ids < hi)
    if zero == ZERO_UNOWNED:
        dst[~owned] = 0
    elif zero == ZERO_INVALID:
        dst[(ids < 0) | (ids >= valid_hi)] = 0
    rows = owned.nonzero().squeeze(1)
    dst[rows] = src[ids[rows] - lo] if lookup else src[rows]
