"""Shared pieces of the trainer tests: a small text corpus and configs for tiny runs."""
from __future__ import annotations

import os

from tpflash.train.config import TrainConfig, from_dict

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400))


def write_corpus(directory: str) -> str:
    """A ~12 KB text file under `directory`; returns its path."""
    path = os.path.join(directory, "corpus.txt")
    with open(path, "w") as f:
        f.write(TEXT)
    return path


def tiny_config(data: str, **overrides) -> TrainConfig:
    """A byte-level run of a few steps on `data` (nested overrides as in YAML)."""
    tree = {"seed": 7, "model": {"block_size": 16},
            "data": {"path": [data], "eval_fraction": 0.1, "seq_len": 16},
            "train": {"steps": 6, "batch_size": 4, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
                      "eval_batches": 1},
            "log": {"interval": 1, "progress": "none"}}
    for key, value in overrides.items():
        section = tree.setdefault(key, {}) if isinstance(value, dict) else None
        if section is not None:
            section.update(value)
        else:
            tree[key] = value
    return from_dict(tree)
