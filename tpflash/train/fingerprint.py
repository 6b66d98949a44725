"""What every rank of a training job must agree on: its fingerprint, checked once at start-up.

Ranks that were launched with different arguments, or that read different data, do not fail
by themselves: a different `log.interval` or `checkpoint.interval` leaves one rank waiting in a
collective the others never call, a different model or batch size hangs or crashes inside NCCL,
and tp ranks that read different tokens train silently wrong (each rank's shard of the model
sees another batch). So the trainer hands this fingerprint to `tpflash.parallel.init(agree=...)`,
which compares it across all ranks right after the world's process group exists and before the
(dp, tp) mesh is built (ranks with different tp or dp would otherwise build different meshes), and every rank
raises the same error when they differ.

The fingerprint is the resolved config field by field, the resolved model config, and the
training and held-out tokens by length and a digest of evenly spaced windows (for jsonl data, the
packed rows' inputs and targets: tpflash.train.packing.PackedRows.tokens). Paths are compared
only as set or unset (nodes may mount the same files under different paths): the digest decides
whether the data is the same.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Dict, Optional

import numpy as np

PATH_KEYS = ("data.path", "checkpoint.dir", "log.dir", "model.init_from")  # may differ between nodes: set/unset
DIGEST_WINDOWS, DIGEST_WINDOW_TOKENS = 16, 4096  # reads 64K tokens however large the memmap


def _flatten(tree: Dict, prefix: str = "") -> Dict[str, str]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = repr(value)
    return out


def tokens_digest(tokens: Optional[np.ndarray]) -> str:
    """"<length>:<sha1 prefix>" of `tokens` (1-D), read in DIGEST_WINDOWS evenly spaced windows."""
    if tokens is None:
        return "none"
    n = len(tokens)
    h = hashlib.sha1()
    step = max(1, (n - DIGEST_WINDOW_TOKENS) // max(1, DIGEST_WINDOWS - 1))
    for start in range(0, max(1, n - DIGEST_WINDOW_TOKENS + 1), step)[:DIGEST_WINDOWS]:
        h.update(np.ascontiguousarray(tokens[start: start + DIGEST_WINDOW_TOKENS], dtype=np.int64).tobytes())
    return f"{n}:{h.hexdigest()[:16]}"


def job_fingerprint(cfg, model_config, train_tokens: np.ndarray, eval_tokens: Optional[np.ndarray]) -> Dict[str, str]:
    """What every rank must agree on, as {name: printable value}: each TrainConfig field (paths as
    set/unset), the resolved model config, and the train/eval token streams' digests."""
    fields = _flatten(cfg.to_dict())
    for key in PATH_KEYS:
        fields[key] = "unset" if fields.get(key) in (None, "''", "[]", "None") else "set"
    resolved = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else vars(model_config)
    fields["resolved model"] = repr(sorted(resolved.items()))
    fields["training tokens (count:digest)"] = tokens_digest(train_tokens)
    fields["held-out tokens (count:digest)"] = tokens_digest(eval_tokens)
    return fields
