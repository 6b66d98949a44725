"""A tiny tensor-parallel language model from tpflash's layers, and its training step, for checkpoint tests.

VocabParallelEmbedding -> blocks of (LayerNorm -> ColumnParallel -> GELU -> RowParallel, residual)
-> LayerNorm -> ColumnParallel head (gathered). The vocabulary (13) is odd, so the embedding is
padded differently at every tp. Built with the same seed, any tp starts from the same weights.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tpflash.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpflash.parallel import comm
from tpflash.parallel.sharding import iter_sharded
from tpflash.parallel.state import get_default_state, set_default_state

VOCAB, DIM, LAYERS, HEAD = 13, 8, 2, 16  # HEAD: vocab rounded up so the head splits over tp <= 4
BATCH, SEQ = 8, 4


class TinyBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = ColumnParallelLinear(dim, 4 * dim)
        self.down = RowParallelLinear(4 * dim, dim)

    def forward(self, x):  # [batch, seq, dim]
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    block_class = TinyBlock

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = LAYERS):
        super().__init__()
        self.vocab = vocab
        self.embed = VocabParallelEmbedding(vocab, dim)
        self.blocks = nn.ModuleList(TinyBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = ColumnParallelLinear(dim, HEAD, gather_output=True)

    def forward(self, ids, targets):  # ids, targets: [batch, seq]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))[..., :self.vocab]  # [batch, seq, vocab]
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


@contextlib.contextmanager
def without_tp():
    """Build layers as tp=1 inside a multi-rank body (the default state is hidden meanwhile)."""
    saved = get_default_state()
    set_default_state(None)
    try:
        yield
    finally:
        set_default_state(saved)


def build(seed: int = 0, tp: bool = True) -> TinyLM:
    torch.manual_seed(seed)
    if tp:
        return TinyLM()
    with without_tp():
        return TinyLM()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int):
    """The global batch of `step` (the same on every rank): (ids, targets) [BATCH, SEQ]."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def train(model, optimizer, steps: range, dp_rank: int = 0, dp_size: int = 1) -> list:
    """Run `steps` (this dp rank's rows of each global batch); return the losses of this rank."""
    losses = []
    for step in steps:
        ids, targets = batch(step)
        rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
        loss = model(ids[rows], targets[rows])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def unshard(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a tensor laid out like parameter `name` (gathered over dp, then tp)."""
    specs = {key: (spec, group) for key, spec, group in iter_sharded(model)}
    t = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    if name in specs:
        spec, group = specs[name]
        t = spec.unpad(comm.all_gather(t, spec.dim, group))
    return t.clone()


@torch.no_grad()
def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Unsharded parameters and AdamW state by name: {"<param>", "<param>.exp_avg", ..., "<param>.step"}."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = unshard(model, name, p)
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{name}.{key}"] = unshard(model, name, value) if value.dim() else value.clone()
    return out


def assert_loads_back(path: str, before: Dict[str, torch.Tensor]) -> None:
    """A fresh model and optimizer loaded from checkpoint `path` hold exactly `before` (a full_state)."""
    import tpflash.checkpoint
    fresh = build(seed=1)
    fresh_optimizer = make_optimizer(fresh)
    tpflash.checkpoint.load(path, fresh, fresh_optimizer)
    after = full_state(fresh, fresh_optimizer)
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{path}, {key}: not the state at its save"
