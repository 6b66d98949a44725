"""Offline consolidation: one unsharded safetensors file (and a Hugging Face model dir) from a checkpoint.

Runs in a single CPU process with no torch.distributed setup: DCP's no-dist load reads every
chunk of each "model.*" tensor into a full-size CPU tensor, whatever (dp, tp) wrote it. (For a
Hugging Face directory alone, `export_hf.py` reads one tensor at a time instead of the model.)
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import directory, integrity
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
    """Write the Hugging Face model directory of checkpoint `path` from its full tensors (in memory here)
    with the streaming writer of tpflash.models.pretrained_save (no transformers model is built)."""
    from .export_hf import stored_config, tensors_from_dict, write_hf
    config = stored_config(directory.resolve(path))
    shapes = {key: value.shape for key, value in tensors.items()}
    write_hf(config, shapes, tensors_from_dict(tensors), hf_dir, "5GB", None, tensors["tok_embeddings.weight"].dtype)


def consolidate(src: str, out: str, hf_dir: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Write the unsharded model of checkpoint `src` to safetensors file `out` (and a HF dir); return the tensors."""
    from safetensors.torch import save_file
    tensors = load_model_tensors(src)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={"source": os.path.abspath(src)})
    if hf_dir is not None:
        export_hf(src, tensors, hf_dir)
    return tensors
