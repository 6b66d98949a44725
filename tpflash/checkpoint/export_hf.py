"""Offline export of a tpflash checkpoint to a Hugging Face model directory, tensor by tensor.

`python -m tpflash.checkpoint export-hf CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--tokenizer-from HF_DIR]`
runs in one CPU process with no process group. The model's config comes from the checkpoint's
model_config.json; each Hugging Face tensor's parts are read with DCP's no-dist load into
full-size tensors of just those keys (whatever (dp, tp) wrote them), written into their
safetensors file and dropped, so the process holds one tensor at a time, never the model.
The output is the one `tpflash.models.save_pretrained` writes.
"""
from __future__ import annotations

import ctypes
import os
from typing import Dict, List, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..models.hf import hf_tensor
from ..models.hf_config import hf_config_dict
from ..models.pretrained_save import check_export_args, hf_plan, write_hf_dir
from . import directory, integrity
from .consolidate import load_in_one_process
from .layout import MODEL_PREFIX


def stored_config(path: str):
    """The GPTConfig saved with checkpoint directory `path`; ValueError when there is none or it is not a GPT's."""
    from .model_loader import saved_config
    config_cls, fields, _ = saved_config(path)
    if config_cls.__name__ != "GPTConfig":
        raise ValueError(f"{path}: the saved model's config is a {config_cls.__qualname__}; only tpflash GPT "
                         "models (GPTConfig) have a Hugging Face layout")
    return config_cls(**fields)


def tensors_from_dict(tensors: Dict[str, torch.Tensor]):
    """A fetch function (see write_hf_dir) over full tpflash tensors already in memory."""
    return lambda parts: hf_tensor(parts, tensors)


def _large_blocks_from_mmap() -> None:
    """Serve every allocation of 1 MiB or more with its own mmap, returned to the OS when freed. glibc
    otherwise raises that threshold up to 32 MiB as blocks are freed and keeps such blocks in its heap,
    where DCP's read buffers of successive tensors fragment it. This tool is one offline process."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _release_freed_heap() -> None:
    """Return freed heap pages to the OS (glibc keeps freed blocks under 32 MiB in its heap, where
    DCP's per-chunk read buffers would otherwise add up across tensors). A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _dcp_fetch(reader: dcp.FileSystemReader, saved: dict):
    """A fetch function that reads just the parts' keys from the checkpoint (full-size, CPU)."""

    def fetch(parts):
        _release_freed_heap()  # the last tensor's DCP read buffers: keep the process at one tensor's worth
        state = {MODEL_PREFIX + key: torch.empty(saved[MODEL_PREFIX + key].size,
                                                 dtype=saved[MODEL_PREFIX + key].properties.dtype) for key, _ in parts}
        load_in_one_process(state, reader)
        return hf_tensor(parts, {key[len(MODEL_PREFIX):]: value for key, value in state.items()})
    return fetch


def write_hf(cfg, shapes: Dict[str, torch.Size], fetch, out_dir: str, max_shard_size: Union[int, str],
             tokenizer_from: Optional[str], dtype: torch.dtype) -> str:
    """Write the Hugging Face directory of a GPT of `cfg` whose full tensors {key: shape} `fetch` gives."""
    max_bytes = check_export_args(out_dir, max_shard_size, tokenizer_from)
    hf_config_dict(cfg)  # ValueError for a config no Hugging Face family describes
    error = write_hf_dir(out_dir, cfg, hf_plan(cfg, shapes, dtype), max_bytes, fetch, True, tokenizer_from)
    if error is not None:
        raise error
    return out_dir


def export_hf(src: str, out_dir: str, max_shard_size: Union[int, str] = "5GB", tokenizer_from: Optional[str] = None,
              dtype: Optional[torch.dtype] = None, verify: bool = True) -> str:
    """Write checkpoint `src` (a step dir or a root: its latest) as a Hugging Face model directory
    `out_dir`, in the checkpoint's dtype unless `dtype` is given. Returns out_dir."""
    path = directory.resolve(src)
    _large_blocks_from_mmap()
    if verify:
        integrity.verify(path)
    cfg = stored_config(path)
    reader = dcp.FileSystemReader(path)
    saved = {k: m for k, m in reader.read_metadata().state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX) and isinstance(m, TensorStorageMetadata)}
    shapes = {k[len(MODEL_PREFIX):]: m.size for k, m in saved.items()}
    dtype = dtype or saved[MODEL_PREFIX + "tok_embeddings.weight"].properties.dtype
    return write_hf(cfg, shapes, _dcp_fetch(reader, saved), out_dir, max_shard_size, tokenizer_from, dtype)


def output_files(out_dir: str) -> List[str]:
    """The files of an exported directory, for messages."""
    return sorted(os.listdir(out_dir))
