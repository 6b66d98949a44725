"""Autoregressive sampling from a tensor-parallel GPT: every tp rank returns the same tokens."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel import comm
from ..parallel.state import group_size


def _last_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits of the last position, [batch, vocab_size], on every tp rank."""
    seq, tp = idx.shape[1], group_size(model.process_group)
    if model.sequence_parallel and seq % tp:  # right-pad; causal attention keeps earlier positions exact
        idx = F.pad(idx, (0, tp - seq % tp))
    logits = model(idx)[:, seq - 1]  # [batch, V'/tp]
    return comm.all_gather(logits.contiguous(), -1, model.process_group)[:, :model.config.vocab_size]


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int]) -> torch.Tensor:
    """[batch, vocab] -> [batch, 1] token ids (greedy when temperature == 0)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None) -> torch.Tensor:
    """Append `max_new_tokens` sampled tokens to idx [batch, seq] -> [batch, seq + max_new_tokens].

    The context is cropped to block_size (under SP: rounded down to a multiple of tp); each step re-runs the model on it (no kv cache).
    Collective over the tp group: call on all tp ranks with the same idx. Tokens are sampled on
    tp rank 0 and broadcast, so every rank returns the same tensor whatever its RNG state.
    temperature=0 is greedy; top_k keeps the k most likely tokens.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if getattr(model, "cp_group", None) is not None:
        raise ValueError(f"generate runs without context parallelism (the model has cp={model.cp}): build the "
                         "model for sampling with cp_group=tpflash.parallel.NO_GROUP")
    group = model.process_group
    src = None if group is None else dist.get_global_rank(group, 0)
    window = model.config.block_size
    if model.sequence_parallel:  # the padded context must still fit in block_size
        window -= window % group_size(group)
    for _ in range(max_new_tokens):
        context = idx[:, -window:]
        token = _sample(_last_logits(model, context), temperature, top_k)
        if group_size(group) > 1:
            dist.broadcast(token, src=src, group=group)
        idx = torch.cat([idx, token.to(idx.dtype)], dim=1)
    return idx
