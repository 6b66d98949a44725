"""Streaming load of a Hugging Face model directory onto any (dp, tp): `from_pretrained`.

The model is built on the meta device (no memory, no random init), sharded with FSDP while still
on meta when asked, then given real but uninitialised storage (`to_empty`). Each rank then
reads, tensor by tensor, only the block of each Hugging Face tensor that it holds: its tp shard
(ShardSpec: rows/cols [r*chunk, (r+1)*chunk) of the zero-padded tensor) intersected with its
FSDP shard (dim 0 of the tp-local tensor split over the dp mesh). safetensors maps the files, so
a slice is read straight from the page cache into the parameter: a rank's private memory grows
by about its own shard, never by the model. No communication; transformers is not imported.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from ..parallel.sharding import ShardSpec, dp_block, iter_sharded
from ..parallel.state import get_default_state, group_rank, group_size
from .config import GPTConfig
from .gpt import GPT
from .hf import HFSource, hf_sources
from .hf_config import config_from_hf_dict
from .safetensors_io import HFFiles

CONFIG_FILE = "config.json"


def read_hf_config(hf_dir: str) -> GPTConfig:
    """The GPTConfig of the Hugging Face model in `hf_dir` (its config.json; ValueError naming what is wrong)."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{hf_dir!r} has no {CONFIG_FILE}: not a local Hugging Face model directory")
    with open(path) as f:
        return config_from_hf_dict(json.load(f))


@dataclasses.dataclass
class _Target:
    """One tpflash tensor to fill: the live parameter (plain, or FSDP's DTensor), its tp layout and HF source."""

    key: str
    param: torch.Tensor
    spec: Optional[ShardSpec]
    tp_rank: int
    tp_size: int
    source: HFSource

    def full_shape(self) -> Tuple[int, ...]:
        """The unsharded tpflash shape (an FSDP DTensor's shape is the tp-local one)."""
        shape = list(self.param.shape)
        if self.spec is not None:
            shape[self.spec.dim] = self.spec.full_size
        return tuple(shape)

    def hf_shape(self) -> Tuple[int, ...]:
        """The shape the Hugging Face tensor holding this one must have."""
        shape = list(self.full_shape())
        if self.source.part is not None:
            shape[0] *= self.source.part[1]
        return tuple(reversed(shape)) if self.source.transpose else tuple(shape)


def targets(model: torch.nn.Module) -> List[_Target]:
    """A _Target per state-dict entry of a GPT (tp shard specs from the modules, HF names from hf.py)."""
    sharded = {key: (spec, group) for key, spec, group in iter_sharded(model)}
    tensors = model.state_dict(keep_vars=True)
    sources = hf_sources(model.config, tensors.keys())
    out = []
    for key, param in tensors.items():
        spec, group = sharded.get(key, (None, None))
        out.append(_Target(key, param, spec, group_rank(group), group_size(group), sources[key]))
    return out


def check_files(model: torch.nn.Module, files: HFFiles) -> Dict[str, str]:
    """{tpflash key: name in the files} after checking that every tensor `model` needs is there with
    the expected full shape; ValueError naming the tensor, the file and both shapes otherwise.
    Reads headers only, no communication: every rank reaches the same verdict."""
    names = {}
    for t in targets(model):
        name = files.lookup(t.source.key)
        if name is None:
            raise ValueError(f"{files.hf_dir!r}: tensor {t.source.key!r} (tpflash {t.key}) is in none of its "
                             f"files ({files.describe()})")
        info = files.tensors[name]
        if info.shape != t.hf_shape():
            raise ValueError(f"{info.file}: tensor {name!r} has shape {info.shape}, the model expects "
                             f"{t.hf_shape()} (tpflash {t.key}); config.json and the weights disagree")
        names[t.key] = name
    return names


def _local_block(param: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
    """(this rank's storage of `param`, its offset per dim in the tp-local tensor; sharding.dp_block)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.detach(), dp_block(param)[0]


def owned_block(target: _Target) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
    """(this rank's storage of the target, the view of its real part, that view's offset per dim in the
    unsharded tensor). The real part is a prefix along the tp dim: padding comes only at the end, and
    a rank holding only padding gets an empty view. Under FSDP the storage is the DTensor's local shard."""
    local, offsets = _local_block(target.param)
    view = local
    if target.spec is not None:  # tp-local -> unsharded coordinates, padding clipped
        d, full = target.spec.dim, target.spec.full_size
        start = min(target.tp_rank * target.spec.chunk(target.tp_size) + offsets[d], full)
        view = local.narrow(d, 0, min(local.shape[d], full - start))
        offsets[d] = start
    return local, view, offsets


def _fill(target: _Target, file, name: str) -> int:
    """Copy this rank's block of HF tensor `name` (from the open safe_open `file`) into the target,
    zeroing tp padding; returns the bytes read. The block is [rows, cols] (or [rows]) of the
    unsharded tpflash tensor, read from the HF tensor through `HFSource.box`."""
    local, view, offsets = owned_block(target)
    if target.spec is not None and view.shape != local.shape:  # padding rows of a padded vocabulary stay zero
        d = target.spec.dim
        local.narrow(d, view.shape[d], local.shape[d] - view.shape[d]).zero_()
    if view.numel() == 0:
        return 0
    ranges = [(o, o + n) for o, n in zip(offsets, view.shape)]
    slices, transpose = target.source.box(ranges[0], target.hf_shape(), ranges[1] if len(ranges) > 1 else None)
    piece = file.get_slice(name)[slices]  # a view of the mapped file: nothing is copied until copy_
    view.copy_(piece.t() if transpose else piece)  # converts the dtype element by element, no full temporary
    return piece.numel() * piece.element_size()


def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(message, file=sys.stderr, flush=True)


@torch.no_grad()
def load_pretrained_weights(model: torch.nn.Module, hf_dir: str, files: Optional[HFFiles] = None,
                            verbose: Optional[bool] = None) -> int:
    """Fill every tensor of `model` (a GPT, plain or FSDP-sharded, on real storage) with its block of
    the Hugging Face weights in `hf_dir`, converting to each parameter's dtype; returns bytes read.

    Each rank reads only its own slices; no communication (call on any subset of ranks). Rank 0 of
    the job (`verbose` None) logs one line per file to stderr. Checks the files first (check_files).
    """
    from safetensors import safe_open

    files = files or HFFiles(hf_dir)
    names = check_files(model, files)
    if verbose is None:
        verbose = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    _check_no_uninitialised_buffers(model)
    by_file: Dict[str, List[_Target]] = defaultdict(list)
    for t in targets(model):
        by_file[files.tensors[names[t.key]].file].append(t)
    done = 0
    for k, (path, in_file) in enumerate(sorted(by_file.items())):
        _log(f"[tpflash] loading {os.path.basename(path)} ({k + 1}/{len(by_file)}, {len(in_file)} tensors)", verbose)
        with safe_open(path, framework="pt") as f:
            for t in in_file:
                done += _fill(t, f, names[t.key])
    return done


def _check_no_uninitialised_buffers(model: torch.nn.Module) -> None:
    """to_empty leaves garbage in buffers that are not in the state dict (nothing loads them). GPT has
    none (rotary tables are computed on first use); a model that adds one must initialise it here."""
    persistent = set(model.state_dict().keys())
    extra = [name for name, _ in model.named_buffers() if name not in persistent]
    if extra:
        raise NotImplementedError(f"non-persistent buffers {extra[:3]} would be left uninitialised by a "
                                  "streaming load: initialise them in tpflash.models.pretrained")


def build_on_meta(cfg: GPTConfig, process_group=None, dtype: Optional[torch.dtype] = None) -> GPT:
    """A GPT of `cfg` on the meta device (no storage, no random init), for FSDP and `to_empty`."""
    with torch.device("meta"):
        return GPT(cfg, process_group=process_group, dtype=dtype)


def from_pretrained(hf_dir: str, process_group=None, sequence_parallel: bool = False, fsdp: bool = False,
                    dtype: Optional[torch.dtype] = None, device=None, **overrides) -> GPT:
    """A tpflash GPT holding the weights of the Hugging Face model saved in `hf_dir` (config.json +
    model.safetensors or sharded model-0000k-of-0000N.safetensors with their index), read in slices.

    process_group: the tp group (default: the default state's, else tp=1). fsdp: shard with
    `tpflash.parallel.apply_fsdp` over the default state's dp mesh (needs tpflash.parallel.init).
    dtype: the parameters' dtype (default: the checkpoint's). device: default the default state's
    device, else CPU. `overrides` replace GPTConfig fields (e.g. dropout, activation_checkpointing).
    Bad input (missing files or tensors, wrong shapes, unsupported model types) raises ValueError
    on every rank before any collective. Under FSDP every rank of the dp mesh must call it.
    """
    cfg = dataclasses.replace(read_hf_config(hf_dir), sequence_parallel=sequence_parallel, **overrides)
    files = HFFiles(hf_dir)
    state = get_default_state()
    if dtype is None:  # the checkpoint's dtype: that of the token embedding
        name = files.lookup(hf_sources(cfg, ["tok_embeddings.weight"])["tok_embeddings.weight"].key)
        dtype = files.tensors[name].dtype if name is not None else torch.get_default_dtype()
    if device is None:
        device = state.device if state is not None else torch.device("cpu")
    model = build_on_meta(cfg, process_group, dtype)
    check_files(model, files)  # before FSDP: bad files raise here on every rank
    if fsdp:
        from ..parallel.fsdp import apply_fsdp
        apply_fsdp(model, state)
    model.to_empty(device=device)
    load_pretrained_weights(model, hf_dir, files)
    return model
