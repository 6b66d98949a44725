"""Offline consolidation: one unsharded safetensors file (and a Hugging Face model dir) from a checkpoint.

Runs in a single CPU process with no torch.distributed setup: DCP's no-dist load reads every
chunk of each "model.*" tensor into a full-size CPU tensor, whatever (dp, tp) wrote it.
"""
from __future__ import annotations

import importlib
import json
import os
import warnings
from typing import Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import directory, integrity
from .extras import CONFIG_FILE
from .layout import MODEL_PREFIX


def load_in_one_process(state: Dict[str, object], reader: dcp.FileSystemReader) -> None:
    """dcp.load(state) in this process alone, without DCP's warning that this is what it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)


def load_model_tensors(path: str, verify: bool = True) -> Dict[str, torch.Tensor]:
    """{state-dict key: unsharded CPU tensor} of the model in checkpoint `path` (a step dir or a root)."""
    path = directory.resolve(path)
    if verify:
        integrity.verify(path)
    reader = dcp.FileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in saved.items()
             if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    load_in_one_process(state, reader)
    return {key[len(MODEL_PREFIX):]: value for key, value in state.items()}


def _import(qualified: str):
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def export_hf(path: str, tensors: Dict[str, torch.Tensor], hf_dir: str) -> None:
    """Rebuild the tpflash model from its stored config (tp=1, CPU), then save it with `tpflash.models.to_hf`."""
    config_path = os.path.join(directory.resolve(path), CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no {CONFIG_FILE}: the saved model had no `.config`, so no Hugging Face "
                         "model can be built (the safetensors file was written)")
    with open(config_path) as f:
        stored = json.load(f)
    from tpflash.models import to_hf
    from tpflash.parallel.state import get_default_state, set_default_state
    config = _import(stored["class"])(**stored["fields"])
    saved_state = get_default_state()
    set_default_state(None)  # an unsharded (tp=1) model, even inside a distributed job
    try:
        model = _import(stored["model_class"])(config)
    finally:
        set_default_state(saved_state)
    model.load_state_dict(tensors)
    to_hf(model).save_pretrained(hf_dir)


def consolidate(src: str, out: str, hf_dir: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Write the unsharded model of checkpoint `src` to safetensors file `out` (and a HF dir); return the tensors."""
    from safetensors.torch import save_file
    tensors = load_model_tensors(src)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={"source": os.path.abspath(src)})
    if hf_dir is not None:
        export_hf(src, tensors, hf_dir)
    return tensors
