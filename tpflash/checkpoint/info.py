"""What a checkpoint holds, and whether its files are intact: `python -m tpflash.checkpoint info DIR`.

One CPU process, no torch.distributed setup, nothing loaded but the small `meta` entry: for
checking a checkpoint before resuming it elsewhere (another cluster, another (dp, tp)), or in a
job script that must not start from a damaged one (the command exits 1 then).
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import directory, integrity
from .blob import from_blob
from .consolidate import load_in_one_process
from .directory import MANIFEST
from .extras import META_KEY
from .layout import MODEL_PREFIX
from .optim import GROUPS_KEY


def describe(path: str, verify: bool = True) -> Dict[str, object]:
    """A summary of checkpoint `path` (a step directory, or a root: its latest) as a dict: path, step,
    the layout it was saved at, model class, tensors and values, whether it holds optimizer state,
    files and bytes. verify: check every file's size and sha256 first (CheckpointCorruptError,
    naming the file, if one is damaged); otherwise sizes only."""
    path = directory.resolve(path)
    integrity.verify(path, deep=verify)
    with open(os.path.join(path, MANIFEST)) as f:
        files = json.load(f)["files"]
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    model = {k: m for k, m in saved.items() if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    meta = {META_KEY: None}
    load_in_one_process(meta, reader)
    meta = from_blob(meta[META_KEY], f"{path}: entry {META_KEY!r}")
    config = meta.get("model_config") or {}
    return {
        "path": path, "step": meta["step"], "layout": meta["layout"], "torch": meta.get("torch", "?"),
        "model_class": config.get("model_class", "?"), "model_tensors": len(model),
        "model_values": sum(m.size.numel() for m in model.values()), "optimizer": GROUPS_KEY in saved,
        "extras": sorted(meta.get("extras", {})), "files": len(files),
        "bytes": sum(int(e["bytes"]) for e in files.values()), "checked": "sha256" if verify else "sizes",
    }


def format_description(d: Dict[str, object]) -> List[str]:
    """The lines `info` prints for a `describe` result."""
    layout = d["layout"]
    return [
        f"checkpoint {d['path']}: step {d['step']}",
        f"saved at tp={layout.get('tp')} cp={layout.get('cp', 1)} dp={layout.get('dp')} (world {layout.get('world')}) "
        f"with torch {d['torch']}; it loads at any (dp, cp, tp)",
        f"model {d['model_class']}: {d['model_tensors']} tensors, {d['model_values']:,} values"
        + ("; optimizer state" if d["optimizer"] else "; no optimizer state"),
        f"extras: {', '.join(d['extras']) or 'none'}",
        f"{d['files']} files, {d['bytes'] / 2**20:.1f} MiB; "
        + ("every file's sha256 matches its manifest" if d["checked"] == "sha256" else
           "every file has its manifest's size (checksums not read: --no-verify)"),
    ]
