"""Packed batches: several documents per row of ids, kept apart in attention.

A packed batch is ids [batch, seq] with
  cu_seqlens  int32 [n_docs + 1]: the documents' offsets in the batch-major flattening of the ids
              (row b's tokens are flat positions b*seq .. b*seq + seq - 1); documents never cross a
              row, every row boundary is a document boundary, cu_seqlens[0] == 0 and
              cu_seqlens[-1] == batch * seq;
  position_ids int64 [batch, seq]: each token's position in its document (0, 1, ... per document);
  max_seqlen  python int: the longest document.
GPT.forward takes all three; this module checks them and fills in what was left out.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch


def check_packing(idx: torch.Tensor, position_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  max_seqlen: Optional[int]) -> None:
    """Raise ValueError naming the value and the rule for a malformed packed batch (no device sync: the
    values of cu_seqlens are checked only where it lives on the CPU)."""
    batch, seq = idx.shape
    if position_ids is not None:
        if position_ids.shape != idx.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} != idx shape {tuple(idx.shape)}")
        if position_ids.dtype != torch.int64:
            raise ValueError(f"position_ids dtype {position_ids.dtype} must be torch.int64")
    if cu_seqlens is None:
        if max_seqlen is not None:
            raise ValueError(f"max_seqlen={max_seqlen} is given without cu_seqlens")
        return
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with n_docs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens dtype {cu_seqlens.dtype} must be torch.int32")
    if max_seqlen is not None and not 1 <= max_seqlen <= seq:
        raise ValueError(f"max_seqlen={max_seqlen} must be in [1, seq={seq}]")
    if cu_seqlens.device.type == "cpu":
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != batch * seq:
            raise ValueError(f"cu_seqlens must run from 0 to batch*seq={batch * seq}, got {bounds[0]}..{bounds[-1]}")
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens={bounds} must be strictly increasing")
        if not {b * seq for b in range(batch + 1)} <= set(bounds):
            raise ValueError(f"cu_seqlens={bounds} must contain every row boundary (multiples of seq={seq})")


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """position_ids [batch, seq] int64 restarting at 0 at every document start, on cu_seqlens' device,
    computed there (no host sync)."""
    flat = torch.arange(batch * seq, device=cu_seqlens.device, dtype=torch.int64)
    bounds = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(bounds, flat, right=True) - 1  # the document of each flat token
    return (flat - bounds[doc]).view(batch, seq)


def packing_kwargs(idx: torch.Tensor, position_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                   max_seqlen: Optional[int]) -> Dict[str, Any]:
    """The blocks' packed-document arguments, checked and completed: {} for an unpacked batch; else
    position_ids (derived from cu_seqlens when omitted, without a sync) and max_seqlen (computed when
    omitted: one device sync; a trainer that knows it should pass it)."""
    check_packing(idx, position_ids, cu_seqlens, max_seqlen)
    if position_ids is None and cu_seqlens is None:
        return {}
    if cu_seqlens is not None:
        if position_ids is None:
            position_ids = positions_from_cu_seqlens(cu_seqlens, *idx.shape)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return dict(position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
