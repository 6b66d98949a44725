"""Hugging Face safetensors model files: which file holds which tensor, and writing sharded files.

Reading: `HFFiles(hf_dir)` finds `model.safetensors` or the shards named by
`model.safetensors.index.json`, and knows every tensor's file, dtype and shape from the file
headers alone (nothing is read or mapped until a tensor is sliced).

Writing: `plan_shards` assigns tensors to files from their sizes (so every file name knows the
count N before anything is written), and `SafetensorsWriter` writes one file tensor by tensor:
the header first (all offsets are known from the shapes), then each tensor's bytes as they
arrive, so a writer never holds more than the tensor it is given. Files are written under a
temporary name and renamed by `commit_files` once all of them are complete.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TMP_SUFFIX = ".tmp"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def read_header(path: str) -> Dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file (its JSON header only)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a Hugging Face model lives: its file (a path) and its stored dtype and shape."""

    file: str
    dtype: torch.dtype
    shape: Tuple[int, ...]


class HFFiles:
    """The safetensors files of the Hugging Face model in `hf_dir` and the tensors they hold.

    ValueError naming the directory when it holds neither `model.safetensors` nor an index, or
    when the index names a file that is not there. GPT-2 files saved from `GPT2Model` (or old hub
    files) name tensors without the "transformer." prefix: `lookup` accepts both spellings.
    """

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        index, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = [SINGLE_FILE]
        else:
            raise ValueError(f"{hf_dir!r} holds no {SINGLE_FILE} and no {INDEX_FILE}: not a Hugging Face "
                             "model directory with safetensors weights")
        self.files = [os.path.join(hf_dir, name) for name in files]
        missing = [name for name, path in zip(files, self.files) if not os.path.isfile(path)]
        if missing:
            raise ValueError(f"{hf_dir!r}: {INDEX_FILE} names files that are not there: {missing[:5]}")
        self.tensors: Dict[str, TensorInfo] = {}
        for path in self.files:
            for name, meta in read_header(path).items():
                if meta["dtype"] not in _DTYPES:
                    raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']}, which is not supported")
                self.tensors[name] = TensorInfo(path, _DTYPES[meta["dtype"]], tuple(meta["shape"]))

    def lookup(self, name: str) -> Optional[str]:
        """The name under which the files hold tensor `name` (with or without "transformer."), or None."""
        for candidate in (name, name.removeprefix("transformer.")):
            if candidate in self.tensors:
                return candidate
        return None

    def describe(self) -> str:
        """The file names, for error messages."""
        names = [os.path.basename(p) for p in self.files]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


# ---- writing ---------------------------------------------------------------------------------------
def parse_size(size: Union[int, str]) -> int:
    """Bytes in `size`: an int, or "5GB" (10**9), "5GiB" (2**30), "500MB", "100KB" (transformers' units)."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(size), re.IGNORECASE)
        if match is None:
            raise ValueError(f"max_shard_size={size!r} must be bytes or a size such as '5GB', '500MB', '2GiB'")
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
        base = 1024 if "I" in unit else 1000
        value = int(number * base ** "BKMGT".index(unit[0]))
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} must be at least one byte")
    return value


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: Sequence[TensorPlan], max_bytes: int) -> List[List[TensorPlan]]:
    """Tensors grouped into files in order: a file is closed when the next tensor would take it past
    `max_bytes` (a tensor larger than that gets a file of its own, as transformers does)."""
    shards: List[List[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards if shards[0] else []


def shard_file_names(count: int) -> List[str]:
    """model.safetensors for one file, else model-0000k-of-0000N.safetensors."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


class SafetensorsWriter:
    """Writes one safetensors file at `path + ".tmp"`: the header from `plan` at once, then each
    tensor's bytes through `write(name, tensor)`, in plan order. `close()` checks all were written."""

    def __init__(self, path: str, plan: Sequence[TensorPlan]):
        self.path, self.plan, self.next = path, list(plan), 0
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for t in self.plan:
            header[t.name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(path + TMP_SUFFIX, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the plan (it must have the planned name, dtype and shape)."""
        expected = self.plan[self.next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (expected.name, expected.dtype, expected.shape):
            raise RuntimeError(f"{self.path}: got {name} {tensor.dtype} {tuple(tensor.shape)}, planned "
                               f"{expected.name} {expected.dtype} {expected.shape}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))  # no copy: the tensor's own bytes (little-endian hosts)
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.plan):
            raise RuntimeError(f"{self.path}: {len(self.plan) - self.next} planned tensors were not written")


def write_index(out_dir: str, shards: List[List[TensorPlan]], names: List[str]) -> Optional[str]:
    """Write model.safetensors.index.json (as a temporary file) for more than one shard; returns its name."""
    if len(shards) < 2:
        return None
    weight_map = {t.name: name for shard, name in zip(shards, names) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    with open(os.path.join(out_dir, INDEX_FILE + TMP_SUFFIX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return INDEX_FILE


def commit_files(out_dir: str, names: List[str]) -> None:
    """Rename every `name.tmp` in `out_dir` to `name`, then remove weight files of an earlier export
    there that the new one does not have (a different shard count), so no stale shard is mixed in."""
    for name in names:
        os.replace(os.path.join(out_dir, name + TMP_SUFFIX), os.path.join(out_dir, name))
    for name in os.listdir(out_dir):
        stale = name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(name)
        if stale and name not in names:
            os.remove(os.path.join(out_dir, name))
