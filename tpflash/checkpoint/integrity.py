"""Checksums: `manifest.json` lists every file of a checkpoint with its size and the sha256 of each of
its consecutive BLOCK_BYTES pieces.

Blocks rather than one digest per file, because sha256 runs at about 1-2 GB/s on one core: a rank
that writes its whole share as one file (GPU state, api.writer_threads) would otherwise hash it on
one thread, at save and again at load. Blocks are hashed by HASH_THREADS threads side by side
(hashlib releases the GIL).

Save: each rank hashes the files it writes (`__<rank>_*.distcp`) as DCP writes them
(shard_files.ShardFileSystem: each block is hashed just before it is written; no second read),
rank 0 gathers those, hashes the rest (DCP's `.metadata`, ...), checks that DCP's metadata only
points into listed files, and writes the manifest last. Load: every rank checks that each listed
file exists with its size and hashes its share of all the blocks (at the world size of the save, the
files each rank wrote, which it then loads; else block i on rank i % world: `_checker`); one
all_gather of the problems found makes every rank raise the same `CheckpointCorruptError`, naming
the file, instead of some ranks hanging in a collective the others never reach. Manifests that
hold one sha256 per file (`"sha256"`, an earlier format) are still verified.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

from .directory import MANIFEST

FileHashes = Dict[str, Dict[str, object]]  # name -> {"bytes": int, "block_bytes": int, "sha256_blocks": [str]}
BLOCK_BYTES = 16 << 20  # a 24 GB shard file: 1,500 digests (100 KB of manifest)
HASH_THREADS = 4  # blocks read back and hashed side by side, per process
_READ = 1 << 22  # read size of a whole-file digest (earlier manifests)
_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # DCP's shard file of the rank in the name


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or fails its checksum."""


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a whole file, read in chunks (manifests of the earlier format)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ), b""):
            digest.update(block)
    return digest.hexdigest()


def _block_sha256(path: str, offset: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(os.pread(f.fileno(), size, offset)).hexdigest()


def _blocks(nbytes: int, block_bytes: int) -> List[Tuple[int, int]]:
    """(offset, size) of each block of a file of `nbytes` (none for an empty file)."""
    return [(start, min(block_bytes, nbytes - start)) for start in range(0, nbytes, block_bytes)]


def _hash_jobs(jobs: List[Tuple[str, int, int]]) -> List[str]:
    """The sha256 of each (path, offset, size) block, HASH_THREADS at a time."""
    if len(jobs) < 2:
        return [_block_sha256(*job) for job in jobs]
    with ThreadPoolExecutor(min(HASH_THREADS, len(jobs))) as pool:
        return list(pool.map(lambda job: _block_sha256(*job), jobs))


def hash_files(directory: str, names: List[str], known: Optional[Dict[str, List[str]]] = None,
               block_bytes: int = BLOCK_BYTES) -> FileHashes:
    """{name: {"bytes", "block_bytes", "sha256_blocks"}} of the named files in `directory`; `known`
    (name -> block digests of `block_bytes`, e.g. ShardFileSystem.digests) spares reading those
    files again."""
    known = known or {}
    sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in names}
    jobs = [(os.path.join(directory, n), offset, size) for n in names if n not in known
            for offset, size in _blocks(sizes[n], block_bytes)]
    digests = iter(_hash_jobs(jobs))
    out: FileHashes = {}
    for n in names:
        blocks = known[n] if n in known else [next(digests) for _ in _blocks(sizes[n], block_bytes)]
        out[n] = {"bytes": sizes[n], "block_bytes": block_bytes, "sha256_blocks": list(blocks)}
    return out


def _writer(name: str) -> Optional[int]:
    """The rank that wrote a DCP shard file (`__<rank>_<i>.distcp`), None for any other file."""
    found = _SHARD_FILE.match(name)
    return int(found.group(1)) if found else None


def own_files(directory: str, rank: int) -> List[str]:
    """The shard files DCP's FileSystemWriter wrote for `rank`."""
    return sorted(n for n in os.listdir(directory) if _writer(n) == rank)


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
        json.dump({"format": "tpflash-checkpoint-2", "files": entries, **(info or {})}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _checker(name: str, index: int, world: int, by_writer: bool) -> int:
    """The rank that hashes block `index` (counted over all files) of file `name` at load. Where the
    checkpoint is loaded at the world size it was saved at, a shard file's blocks go to the rank that
    wrote it: at the same layout the file holds that rank's own shards of the state, so the load reads
    them again from its own node's page cache, not the filesystem. Otherwise block by block, round-robin."""
    writer = _writer(name) if by_writer else None
    return writer if writer is not None else index % world


def _problems(directory: str, rank: int, world: int, deep: bool) -> List[str]:
    """What is wrong with the files this rank checks (sizes: all files; sha256: its share of the blocks,
    or of the whole files of an earlier manifest)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return [f"{MANIFEST} is missing (the save never finished)"]
    except (ValueError, KeyError) as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    problems, blocks, whole = [], [], []  # blocks: (name, (path, offset, size), want); whole: (name, path, want)
    for name, entry in sorted(files.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            problems.append(f"file {name} is missing")
        elif os.path.getsize(path) != entry["bytes"]:
            problems.append(f"file {name} has {os.path.getsize(path)} bytes, the manifest says {entry['bytes']}")
        elif "sha256_blocks" in entry:
            spans = _blocks(entry["bytes"], entry["block_bytes"])
            if len(spans) != len(entry["sha256_blocks"]):
                problems.append(f"file {name} has {len(spans)} blocks, the manifest lists {len(entry['sha256_blocks'])}")
            blocks += [(name, (path,) + span, want) for span, want in zip(spans, entry["sha256_blocks"])]
        else:
            whole.append((name, path, entry["sha256"]))
    if not deep:
        return problems
    writers = {_writer(name) for name in files} - {None}
    by_writer = sorted(writers) == list(range(world))  # loaded at the world size it was saved at
    mine = [b for i, b in enumerate(blocks) if _checker(b[0], i, world, by_writer) == rank]
    failed = {name for (name, _, want), got in zip(mine, _hash_jobs([job for _, job, _ in mine])) if got != want}
    failed |= {name for name, path, want in whole[rank::world] if file_sha256(path) != want}
    return problems + [f"file {name} fails its sha256 checksum" for name in sorted(failed)]


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
