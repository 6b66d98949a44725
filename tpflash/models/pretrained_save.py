"""Streaming export to a Hugging Face model directory: `save_pretrained` (collective) and the writer
it shares with the offline `python -m tpflash.checkpoint export-hf`.

The output is what transformers' own save_pretrained writes: `model.safetensors`, or
`model-0000k-of-0000N.safetensors` + `model.safetensors.index.json`, then `config.json`,
`generation_config.json` and, from a source model directory, its tokenizer files. Tensors are
fetched one Hugging Face tensor at a time: every rank sends rank 0 the block of it that it holds
(point to point, each distinct block once), and rank 0 writes the tensor straight into its
file. Rank 0 holds one tensor, never a shard file's worth; the other ranks send views of their
own shards. Every file is written as `name.tmp` and renamed once all are complete.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import pretrained
from .config import GPTConfig
from .hf import HFSource, hf_tensor, hf_tensor_names
from .hf_config import hf_config_dict
from .safetensors_io import (TMP_SUFFIX, SafetensorsWriter, TensorPlan, commit_files, parse_size, plan_shards,
                             shard_file_names, write_index)

Parts = List[Tuple[str, HFSource]]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_plan(cfg: GPTConfig, full_shapes: Dict[str, Sequence[int]], dtype: torch.dtype) -> List[Tuple[TensorPlan, Parts]]:
    """(what to write, its tpflash parts) per Hugging Face tensor, in state-dict order, from the
    unsharded tpflash shapes {key: shape}: parts are concatenated along dim 0, then transposed."""
    out = []
    for name, parts in hf_tensor_names(cfg, full_shapes.keys()).items():
        shape = list(full_shapes[parts[0][0]])
        shape[0] = sum(full_shapes[key][0] for key, _ in parts)
        if parts[0][1].transpose:
            shape.reverse()
        out.append((TensorPlan(name, dtype, tuple(shape)), parts))
    return out


def _config_json(cfg: GPTConfig, dtype: torch.dtype, source_dir: Optional[str]) -> dict:
    """config.json: the config's fields, the dtype (both spellings transformers reads), and the
    token ids of the source model's config when there is one (generation needs its eos id)."""
    config = hf_config_dict(cfg)
    name = str(dtype).removeprefix("torch.")
    config.update(torch_dtype=name, dtype=name)
    source = os.path.join(source_dir, "config.json") if source_dir else None
    if source and os.path.isfile(source):
        with open(source) as f:
            original = json.load(f)
        config.update({k: original[k] for k in _TOKEN_IDS if original.get(k) is not None})
    return config


def _write_json(out_dir: str, name: str, value: dict) -> str:
    with open(os.path.join(out_dir, name + TMP_SUFFIX), "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
    return name


def write_side_files(out_dir: str, cfg: GPTConfig, dtype: torch.dtype, tokenizer_from: Optional[str]) -> List[str]:
    """config.json, generation_config.json (the source's if it has one) and the source's tokenizer
    files, as temporary files in `out_dir`; returns their final names."""
    config = _config_json(cfg, dtype, tokenizer_from)
    names = [_write_json(out_dir, "config.json", config)]
    copied = [n for n in TOKENIZER_FILES + ("generation_config.json",)
              if tokenizer_from and os.path.isfile(os.path.join(tokenizer_from, n))]
    for name in copied:
        shutil.copyfile(os.path.join(tokenizer_from, name), os.path.join(out_dir, name + TMP_SUFFIX))
    if "generation_config.json" not in copied:
        generation = {"_from_model_config": True, **{k: config[k] for k in _TOKEN_IDS if k in config}}
        names.append(_write_json(out_dir, "generation_config.json", generation))
    return names + copied


def check_export_args(out_dir: str, max_shard_size: Union[int, str], tokenizer_from: Optional[str]) -> int:
    """max_shard_size in bytes; ValueError naming the value for a bad size or a missing tokenizer_from."""
    if not out_dir:
        raise ValueError("out_dir must name a directory")
    if tokenizer_from and not os.path.isdir(tokenizer_from):
        raise ValueError(f"tokenizer_from={tokenizer_from!r} is not a directory")
    return parse_size(max_shard_size)


def write_hf_dir(out_dir: str, cfg: GPTConfig, plan: List[Tuple[TensorPlan, Parts]], max_bytes: int,
                 fetch: Callable[[Parts], Optional[torch.Tensor]], writer: bool,
                 tokenizer_from: Optional[str] = None) -> Optional[BaseException]:
    """Write the model directory. `fetch(parts)` returns the full HF tensor (on the writer; may be
    None elsewhere) and is called for every tensor on every caller in the same order, whatever
    happens, so that collectives inside it stay in step. Returns the writer's first error (None if
    all went well) instead of raising it, for the caller to share with the other ranks."""
    shards = plan_shards([t for t, _ in plan], max_bytes)
    names = shard_file_names(len(shards))
    parts_of = {t.name: parts for t, parts in plan}
    error: Optional[BaseException] = None
    if writer:
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            error = e
    for shard, file_name in zip(shards, names):
        out = None
        if writer and error is None:
            try:
                out = SafetensorsWriter(os.path.join(out_dir, file_name), shard)
            except OSError as e:
                error = e
        for t in shard:
            tensor = fetch(parts_of[t.name])
            if out is not None and error is None:
                try:
                    out.write(t.name, tensor.to(t.dtype))
                except (OSError, RuntimeError) as e:
                    error = e
            del tensor
        if out is not None:
            try:
                out.close()
            except (OSError, RuntimeError) as e:
                error = error or e
    if writer and error is None:
        try:
            extra = [write_index(out_dir, shards, names)] + write_side_files(out_dir, cfg, plan[0][0].dtype,
                                                                             tokenizer_from)
            commit_files(out_dir, names + [n for n in extra if n])
        except OSError as e:
            error = e
    return error


class _BlockGather:
    """Gathers full tensors on rank 0 from every rank's owned block (pretrained.owned_block: a
    rectangle of the unsharded tensor, tp padding dropped, FSDP's dp split included), by point-to-
    point sends: rank 0 receives each distinct rectangle once (from the lowest rank holding it),
    straight into the full tensor where the rectangle is contiguous there. No rank holds more than
    its blocks, and rank 0 one full tensor. Every rank of the job must take part."""

    def __init__(self, model: torch.nn.Module):
        self.targets = {t.key: t for t in pretrained.targets(model)}
        mine = {key: (offsets, list(view.shape)) for key, t in self.targets.items()
                for _, view, offsets in [pretrained.owned_block(t)]}
        self.rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        everyone = [mine]
        if world > 1:  # one exchange of block coordinates, before any tensor moves
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
        self.blocks = everyone

    def _senders(self, key: str) -> List[Tuple[int, List[int], List[int]]]:
        """(rank, offsets, sizes) of each distinct non-empty rectangle of `key`, lowest rank first."""
        seen, out = set(), []
        for rank, blocks in enumerate(self.blocks):
            offsets, sizes = blocks[key]
            if 0 not in sizes and (tuple(offsets), tuple(sizes)) not in seen:
                seen.add((tuple(offsets), tuple(sizes)))
                out.append((rank, offsets, sizes))
        return out

    def full(self, key: str) -> Optional[torch.Tensor]:
        """The unsharded CPU tensor of `key` on rank 0 (None elsewhere). Collective over the world."""
        t = self.targets[key]
        _, view, _ = pretrained.owned_block(t)
        senders = self._senders(key)
        if self.rank != 0:
            if any(rank == self.rank for rank, _, _ in senders):
                dist.send(view.contiguous(), dst=0)
            return None
        full = torch.empty(t.full_shape(), dtype=view.dtype)
        for rank, offsets, sizes in senders:
            region = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
            if rank == 0:
                region.copy_(view)
            elif region.is_contiguous() and view.device.type == "cpu":
                dist.recv(region, src=rank)  # straight into place: no temporary
            else:
                piece = torch.empty(sizes, dtype=view.dtype, device=view.device)
                dist.recv(piece, src=rank)
                region.copy_(piece)
        return full


def _agree_on_error(error: Optional[BaseException]) -> None:
    """Raise on every rank if the writer (rank 0) failed: one broadcast, so no rank waits on another."""
    message = f"{type(error).__name__}: {error}" if error is not None else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"save_pretrained failed on rank 0: {message}")


@torch.no_grad()
def save_pretrained(model: torch.nn.Module, out_dir: str, max_shard_size: Union[int, str] = "5GB",
                    tokenizer_from: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> str:
    """Write `model` (a tpflash GPT: tp, FSDP or both) as a Hugging Face model directory `out_dir`.

    Collective: call on every rank of the job (each rank sends rank 0 its blocks of each tensor,
    whatever its tp / FSDP layout; rank 0 writes). dtype: default the parameters' dtype.
    max_shard_size: bytes or "5GB"/"2GiB" per file. tokenizer_from: a Hugging Face model
    directory whose tokenizer files (and generation_config.json, and token ids) are copied.
    A tied model writes no lm_head.weight. Returns out_dir.
    """
    max_bytes = check_export_args(out_dir, max_shard_size, tokenizer_from)
    cfg = model.config
    hf_config_dict(cfg)  # ValueError for configs no Hugging Face family describes, before any collective
    gather = _BlockGather(model)
    shapes = {key: t.full_shape() for key, t in gather.targets.items()}
    dtype = dtype or next(iter(gather.targets.values())).param.dtype
    writer = gather.rank == 0

    def fetch(parts: Parts) -> Optional[torch.Tensor]:
        tensors = {key: gather.full(key) for key, _ in parts}
        return hf_tensor(parts, tensors) if writer else None

    _agree_on_error(write_hf_dir(out_dir, cfg, hf_plan(cfg, shapes, dtype), max_bytes, fetch, writer, tokenizer_from))
    return out_dir
