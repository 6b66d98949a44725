"""What a run trains on: its tokenizer, resolved model config, sequence length, and train/eval data.

Read before any process group exists, so that bad data or a bad config raises on every rank alike
instead of inside a collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from . import build, packing, resume_config
from .data import (check_token_ids, load_tokens, make_tokenizer, split_train_eval, token_format, token_source,
                   unigram_entropy)


@dataclass
class RunData:
    """`packed`: fine-tuning examples packed into rows (tpflash.train.packing) rather than token windows;
    `tokenizer`: None for token files (loaded on first use, only to sample); `entropy`: the unigram
    entropy in nats/token of what the loss is taken over; `notes`: lines for the run's log."""

    packed: bool
    tokenizer: object
    model_config: object
    seq_len: int
    train: object
    eval: Optional[object]
    entropy: float
    notes: List[str] = field(default_factory=list)


def load_run_data(cfg, config_cls) -> RunData:
    """The tokenizer, the model config (a resumed run's is the checkpoint's: explicit keys are checked
    against it, tpflash.train.resume_config), and the train/eval split of cfg.data. ValueError for
    a sequence longer than the model's block or a token id outside its vocabulary."""
    packed = token_format(cfg.data) == "jsonl"
    if packed and cfg.cuda_graphs == "on":
        raise ValueError(build.PACKED_GRAPHS_RULE)
    is_text = token_format(cfg.data) in ("text", "jsonl")
    tokenizer = make_tokenizer(cfg.data.tokenizer) if is_text else None
    tokens = None if packed else load_tokens(cfg.data, tokenizer)
    model_config = resume_config.model_config_for_run(cfg, tokenizer.vocab_size if is_text else None, config_cls)
    if hasattr(model_config, "check_tp"):
        model_config.check_tp(cfg.tp)
    seq_len = cfg.data.seq_len or model_config.block_size
    if seq_len > model_config.block_size:
        raise ValueError(f"data.seq_len={seq_len} exceeds model.block_size={model_config.block_size}")
    notes: List[str] = []
    if packed:
        train, eval_data, notes = packing.load_packed(cfg.data, tokenizer, seq_len, cfg.seed)
        counted = train.loss_targets()  # the entropy of what the loss is taken over
    else:
        train, eval_data = split_train_eval(tokens, seq_len, cfg.data.eval_fraction)
        counted = train.tokens
    if tokens is not None:  # every id inside the embedding: found here, not as a failure inside a step
        check_token_ids(tokens, model_config.vocab_size, token_source(cfg.data))
    return RunData(packed, tokenizer, model_config, seq_len, train, eval_data,
                   unigram_entropy(counted, model_config.vocab_size), notes)
