"""Shared pieces of the fine-tuning tests: a stand-in model with GPT's packed-documents interface,
a small chat-template tokenizer built offline, and jsonl data."""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.losses import vocab_parallel_cross_entropy
from tpflash.train.config import from_dict


class PackedTinyLM(TinyLM):
    """TinyLM with GPT's packed-documents keywords: positions from position_ids, and a causal mixing
    layer (each token adds the mean of its document's tokens so far) that stays within the
    documents cu_seqlens gives, so a wrong boundary changes the result."""

    def __init__(self, cfg: TinyConfig, process_group=None, device=None, dtype=None):
        super().__init__(cfg, process_group=process_group, device=device, dtype=dtype)
        self.mix = nn.Linear(cfg.n_embd, cfg.n_embd, device=device, dtype=dtype)  # replicated over tp

    def forward(self, idx, targets=None, position_ids=None, cu_seqlens=None, max_seqlen=None, reduction="mean"):
        batch, seq = idx.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=idx.device).expand(batch, seq)
        if cu_seqlens is None:  # one document per row
            cu_seqlens = torch.arange(batch + 1, device=idx.device, dtype=torch.int32) * seq
        h = self.emb(idx) + self.pos[position_ids]  # [batch, seq, d]
        flat = h.reshape(batch * seq, -1)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        first = torch.repeat_interleave(cu_seqlens[:-1].long(), lens)  # each token's document start
        total = torch.cat([torch.zeros_like(flat[:1]), flat.cumsum(0)])
        prefix = total[1:] - total[first]  # sums over the token's document up to itself
        mean = prefix / (torch.arange(batch * seq, device=idx.device) - first + 1)[:, None]
        h = h + torch.tanh(self.mix(mean)).reshape(batch, seq, -1)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits.float(), targets, self.process_group, reduction=reduction)


def write_jsonl(path: str, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def arithmetic_records(n: int = 60):
    """Prompt/completion records of varied lengths (so rows and ranks hold uneven loss-token counts)."""
    return [{"prompt": f"{i}+{i % 7}=" + " " * (i % 5), "completion": str(i + i % 7) + "!" * (i % 4)}
            for i in range(n)]


def sft_config(data: str, **overrides):
    """A byte-level jsonl run of a few steps (nested overrides as in YAML)."""
    tree = {"seed": 5, "model": {"block_size": 32},
            "data": {"path": [data], "eval_fraction": 0.1, "seq_len": 32},
            "train": {"steps": 6, "batch_size": 4, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
                      "eval_batches": 1},
            "log": {"interval": 1, "progress": "none"}}
    for key, value in overrides.items():
        if isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return from_dict(tree)


CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant : {% endif %}")
CHAT_WORDS = ["user", "assistant", "system", ":", "hi", "hello", "how", "are", "you", "fine", "thanks", "bye",
              "what", "is", "two", "plus", "three", "five"]


def chat_tokenizer(directory: str, template: bool = True) -> str:
    """A word-level tokenizer with <s>/</s> specials (EOS </s>) and, if `template`, CHAT_TEMPLATE,
    saved with save_pretrained under `directory` (no download); returns the directory."""
    import tokenizers
    import transformers
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>"] + CHAT_WORDS)}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>",
                                               eos_token="</s>")
    if template:
        tok.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    tok.save_pretrained(directory)
    return directory
