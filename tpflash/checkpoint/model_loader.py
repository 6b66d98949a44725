"""`load_model`: a checkpoint's model, built from the config it recorded, on the current layout.

    model = tpflash.checkpoint.load_model("ckpt")          # root (its latest) or one step directory
    logits = model(idx)                                     # eval mode; weights of any saved (dp, tp)

The model is built from `model_config.json` (the config class and model class it names, as
`consolidate.py` reads them) on the meta device, sharded over the current tp group (and dp with
fsdp=True), given storage and filled by `tpflash.checkpoint.load`, which reshards whatever
(dp, tp) wrote the checkpoint. No random initialisation runs and no rank holds more than its shard.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..parallel.state import get_default_state
from . import directory
from .api import load
from .consolidate import _import
from .extras import CONFIG_FILE
from .layout import MODEL_PREFIX

DEFAULT_MODEL_CLASS = "tpflash.models.gpt.GPT"  # checkpoints written before model_class was recorded


def saved_config(path: str):
    """(config class, its fields, model class) recorded in checkpoint directory `path`; ValueError when it
    recorded none."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path} has no {CONFIG_FILE}: the saved model had no `.config`, so no model can be "
                         "built from it alone; build the model yourself and call tpflash.checkpoint.load(path, model)")
    with open(file) as f:
        stored = json.load(f)
    return _import(stored["class"]), stored["fields"], _import(stored.get("model_class") or DEFAULT_MODEL_CLASS)


def _saved_dtype(path: str) -> torch.dtype:
    """The dtype the checkpoint's model tensors were saved in (that of the first one)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, meta in saved.items():
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata):
            return meta.properties.dtype
    raise ValueError(f"{path} holds no model tensors")


def load_model(ckpt_dir, process_group=None, sequence_parallel: Optional[bool] = None, fsdp: bool = False,
               device=None, dtype: Optional[torch.dtype] = None, **overrides) -> nn.Module:
    """The model saved in checkpoint `ckpt_dir` (a step directory, or a root: its latest), in eval mode.

    process_group: the tp group (default: the default state's, after tpflash.parallel.init; else
    tp=1 in this process). sequence_parallel: None keeps the saved value. fsdp: shard over the
    default state's dp mesh with tpflash.parallel.apply_fsdp (needs tpflash.parallel.init).
    device: default the default state's device, else CPU. dtype: the parameters' dtype after
    loading (default: the checkpoint's). `overrides` replace config fields (e.g. dropout,
    activation_checkpointing, fused_loss); an unknown name is a ValueError. Every rank of the job
    calls it (loading is collective when torch.distributed is initialised); a bad directory or
    config raises on every rank before the first collective.
    """
    path = directory.resolve(os.fspath(ckpt_dir))
    config_cls, fields, model_cls = saved_config(path)
    known = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set(fields)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"load_model: {unknown} are not fields of {config_cls.__name__}; fields: {sorted(known)}")
    fields = {**fields, **overrides}
    if sequence_parallel is not None:
        fields["sequence_parallel"] = sequence_parallel
    config = config_cls(**fields)
    state = get_default_state()
    if fsdp and state is None:
        raise ValueError("load_model(fsdp=True) shards over the dp mesh: call tpflash.parallel.init first")
    if device is None:
        device = state.device if state is not None else torch.device("cpu")
    with torch.device("meta"):  # no init: every value comes from the checkpoint
        model = model_cls(config, process_group=process_group, dtype=_saved_dtype(path))
    _check_buffers(model, model_cls)
    if fsdp:
        from ..parallel.fsdp import apply_fsdp
        apply_fsdp(model, state)
    model.to_empty(device=device)
    with warnings.catch_warnings():  # without a process group DCP warns that it loads in one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(path, model)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _check_buffers(model: nn.Module, model_cls) -> None:
    """to_empty leaves buffers outside the state dict uninitialised (the checkpoint does not hold
    them): refuse such a model rather than return one with garbage in it."""
    persistent = set(model.state_dict())
    extra = [name for name, _ in model.named_buffers() if name not in persistent]
    if extra:
        raise NotImplementedError(f"load_model: {model_cls.__name__} has non-persistent buffers {extra[:3]}, "
                                  "which a checkpoint does not hold; build it yourself and call tpflash.checkpoint.load")
