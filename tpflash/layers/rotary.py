"""Rotary position embeddings (RoPE), in the non-interleaved ("rotate half") layout Llama uses."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn as nn

from .. import kernels


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position-dependent angles: pair (x[i], x[i + d/2]) at position t turns by
    t * theta^(-2i/d). cos/sin tables are fp32 (the kernel rotates in fp32 whatever q's dtype),
    cached per (length, device); they are not parameters or buffers, so `model.to(bf16)` cannot
    round the angles.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        self.head_dim, self.theta = head_dim, theta
        self._tables: Dict[Tuple, Tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [seq_len, head_dim/2] fp32, for positions 0..seq_len-1."""
        key = (seq_len, device)
        if key not in self._tables:
            exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.int64).float() / self.head_dim
            inv_freq = 1.0 / (self.theta ** exponents)  # [d/2]
            angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.int64).float(), inv_freq)
            self._tables = {key: (angles.cos(), angles.sin())}  # keep one length only
        return self._tables[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q [batch, seq, heads_q, head_dim], k [batch, seq, heads_kv, head_dim] -> rotated (q, k)."""
        cos, sin = self.tables(q.shape[1], q.device)
        return kernels.apply_rotary(q, cos, sin), kernels.apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
