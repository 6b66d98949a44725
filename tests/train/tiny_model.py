"""A tiny tensor-parallel language model with GPT's interface, so the trainer can be tested without
tpflash.models: vocab-parallel embedding, one column->row MLP, a vocab-parallel head."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpflash.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpflash.losses import vocab_parallel_cross_entropy


@dataclass
class TinyConfig:
    vocab_size: int = 256
    block_size: int = 16
    n_embd: int = 32
    n_layer: int = 1
    dropout: float = 0.0

    @classmethod
    def preset(cls, name: str) -> "TinyConfig":
        if name != "tiny":
            raise ValueError(f"unknown preset {name!r}")
        return cls()


class TinyLM(nn.Module):
    """idx [batch, seq] -> vocab-sharded logits [batch, seq, V/tp], or the mean loss given targets."""

    def __init__(self, cfg: TinyConfig, process_group=None, device=None, dtype=None):
        super().__init__()
        d, v = cfg.n_embd, cfg.vocab_size
        self.cfg = cfg
        self.emb = VocabParallelEmbedding(v, d, process_group=process_group, device=device, dtype=dtype)
        self.pos = nn.Parameter(torch.randn(cfg.block_size, d, device=device, dtype=dtype) * 0.1)  # replicated
        self.up = ColumnParallelLinear(d, 4 * d, process_group=process_group, device=device, dtype=dtype)
        self.down = RowParallelLinear(4 * d, d, process_group=process_group, device=device, dtype=dtype)
        self.head = ColumnParallelLinear(d, v, bias=False, process_group=process_group, device=device, dtype=dtype)
        self.process_group = self.head.process_group

    def forward(self, idx, targets=None):
        h = self.emb(idx) + self.pos[: idx.shape[1]]
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)  # [batch, seq, V/tp]
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits.float(), targets, self.process_group)

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())
