"""Per-file checksums: `manifest.json` lists every file of a checkpoint with its size and sha256.

Save: each rank hashes the files it writes (`__<rank>_*.distcp`) as DCP writes them
(HashingFileSystem: no second read), rank 0 gathers those, hashes the rest (DCP's `.metadata`, ...),
checks that DCP's metadata only points into listed files, and writes the manifest last. Load: every
rank checks that each listed file exists with its size and hashes its share of the files (file i on
rank i % world); one all_gather of the problems found makes every rank raise the same
`CheckpointCorruptError`, naming the file, instead of some ranks hanging in a collective the others
never reach.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

from torch.distributed.checkpoint.filesystem import FileSystem

from .directory import MANIFEST

FileHashes = Dict[str, Dict[str, object]]  # name -> {"bytes": int, "sha256": str}
_CHUNK = 1 << 22
HASH_THREADS = 4  # files hashed side by side (hashlib releases the GIL): a rank writes several (api.WRITER_THREADS)


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or fails its checksum."""


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_all(paths: List[str]) -> List[str]:
    """file_sha256 of each path, HASH_THREADS at a time."""
    if len(paths) < 2:
        return [file_sha256(p) for p in paths]
    with ThreadPoolExecutor(min(HASH_THREADS, len(paths))) as pool:
        return list(pool.map(file_sha256, paths))


def hash_files(directory: str, names: List[str], known: Optional[Dict[str, str]] = None) -> FileHashes:
    """{name: {"bytes", "sha256"}} of the named files in `directory`; `known` (name -> sha256, e.g.
    HashingFileSystem.digests) spares reading those files again."""
    known = known or {}
    paths = [os.path.join(directory, n) for n in names]
    unknown = [p for n, p in zip(names, paths) if n not in known]
    read = dict(zip(unknown, _sha256_all(unknown)))
    return {n: {"bytes": os.path.getsize(p), "sha256": known[n] if n in known else read[p]}
            for n, p in zip(names, paths)}


class _HashingWriter:
    """A binary file being written, hashing every byte on its way in. Any seek makes the digest unusable
    (None): the hash then comes from reading the file back."""

    def __init__(self, raw):
        self.raw, self._sha, self._appended_only = raw, hashlib.sha256(), True

    def write(self, data) -> int:
        written = self.raw.write(data)
        view = memoryview(data).cast("B")
        if written is not None and written != view.nbytes:  # a short write: what reached the file is unknown
            self._appended_only = False
        self._sha.update(view)  # hashlib releases the GIL on large buffers
        return written

    def seek(self, *args) -> int:
        self._appended_only = False
        return self.raw.seek(*args)

    def hexdigest(self) -> Optional[str]:
        return self._sha.hexdigest() if self._appended_only else None

    def __getattr__(self, name):  # tell, flush, fileno, close, ...: the file's own
        return getattr(self.raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local FileSystem (give it to a FileSystemWriter as `.fs`) that hashes each file it writes
    while writing it: `digests` maps file name -> sha256 for every file written front to back."""

    def __init__(self):
        super().__init__()
        self.digests: Dict[str, str] = {}
        self._lock = threading.Lock()  # DCP's writer threads each write their own files

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode or "+" in mode:
                yield raw
                return
            stream = _HashingWriter(raw)
            yield stream
        digest = stream.hexdigest()
        if digest is not None:
            with self._lock:
                self.digests[os.path.basename(os.fspath(path))] = digest


def own_files(directory: str, rank: int) -> List[str]:
    """The shard files DCP's FileSystemWriter wrote for `rank`."""
    prefix = f"__{rank}_"
    return sorted(n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".distcp"))


def complete_manifest(directory: str, gathered: List[FileHashes]) -> FileHashes:
    """Merge every rank's hashes, hash the files nobody claimed, and check DCP's metadata references."""
    entries: FileHashes = {}
    for part in gathered:
        entries.update(part)
    rest = [n for n in sorted(os.listdir(directory)) if n not in entries and n != MANIFEST]
    entries.update(hash_files(directory, rest))
    from torch.distributed.checkpoint import FileSystemReader
    storage = FileSystemReader(directory).read_metadata().storage_data or {}
    for index, info in storage.items():
        entry = entries.get(info.relative_path)
        if entry is None or info.offset + info.length > entry["bytes"]:
            raise CheckpointCorruptError(f"save of {directory} is incomplete: {info.relative_path} "
                                         f"(holding {index.fqn}) is missing or too short")
    return entries


def write_manifest(directory: str, entries: FileHashes, info: Optional[dict] = None) -> None:
    """Write the manifest of `entries` (and `info`) into `directory` atomically: a temporary file,
    fsync'd, then renamed."""
    path = os.path.join(directory, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump({"format": "tpflash-checkpoint-1", "files": entries, **(info or {})}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _problems(directory: str, rank: int, world: int, deep: bool) -> List[str]:
    """What is wrong with the files this rank checks (sizes: all files; sha256: its share)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return [f"{MANIFEST} is missing (the save never finished)"]
    except (ValueError, KeyError) as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    problems, to_hash = [], []
    for i, (name, entry) in enumerate(sorted(files.items())):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"file {name} is missing")
        elif os.path.getsize(path) != entry["bytes"]:
            problems.append(f"file {name} has {os.path.getsize(path)} bytes, the manifest says {entry['bytes']}")
        elif deep and i % world == rank:
            to_hash.append((name, path, entry["sha256"]))
    digests = _sha256_all([path for _, path, _ in to_hash])
    problems += [f"file {name} fails its sha256 checksum" for (name, _, want), got in zip(to_hash, digests) if got != want]
    return problems


def verify(directory: str, rank: int = 0, world: int = 1,
           all_gather: Optional[Callable[[object], List[object]]] = None, deep: bool = True) -> None:
    """Raise CheckpointCorruptError (the same on every rank) if any file of the checkpoint is damaged.

    `all_gather(obj) -> [obj of every rank]` is the one collective (None: single process).
    """
    try:
        mine = _problems(directory, rank, world, deep)
    except OSError as e:
        mine = [f"cannot be read ({e})"]
    everyone = all_gather(mine) if all_gather is not None else [mine]
    problems = sorted({p for part in everyone for p in part})
    if problems:
        raise CheckpointCorruptError(f"checkpoint {directory} is corrupt: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more problems: {problems[1:4]})"
                                        if len(problems) > 1 else ""))
