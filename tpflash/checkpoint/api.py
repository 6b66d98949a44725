"""`save`, `load` and `latest`: sharded checkpoints over torch.distributed.checkpoint (DCP).

The directory is a standard DCP checkpoint plus `manifest.json` (checksums) and, when the
model has a `.config`, `model_config.json`. Keys: "model.<state-dict key>" (unsharded shapes,
see layout.py), "optim.*" (optim.py), "meta" and "rng.rank_<r>" (extras.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Collection, Dict, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..parallel.state import get_default_state
from . import directory, integrity, optim
from .blob import UnsafeCheckpointError, from_blob, to_blob
from .directory import latest
from .extras import (CONFIG_FILE, META_KEY, RNG_PREFIX, meta_for_save, model_config, restore_extras, rng_state,
                     set_rng_state, split_meta_keys)
from .layout import MODEL_PREFIX, Chunk, model_slots
from .planner import ChunkLoadPlanner, ChunkSavePlanner
from .staging import HostStaging, PendingSave, async_group, fits_in_host_memory, host_memory_available
from .shard_files import ShardFileSystem

__all__ = ["save", "load", "latest", "wait_pending", "reserve_staging"]

# Each rank writes host-memory state (a staged copy: every async save, and a synchronous one where the
# host has room) into this many files at once: one writer thread leaves a fast disk idle while it
# serialises. State still on the GPU goes through one thread, where DCP overlaps the device-to-host
# copies with the writing (its threaded writers copy each tensor synchronously): docs/performance.md,
# "Checkpoints of a large model".
WRITER_THREADS = 4


def writer_threads(state: dict) -> int:
    """DCP writer threads for `state`: 1 if any tensor in it is on a CUDA device, else WRITER_THREADS."""
    def on_cuda(value) -> bool:
        tensor = value.piece if isinstance(value, Chunk) else value
        return torch.is_tensor(tensor) and tensor.is_cuda
    return 1 if any(on_cuda(v) for v in state.values()) else WRITER_THREADS


_pending: Dict[str, PendingSave] = {}  # background saves per root (abspath), so save/load can wait on them


def wait_pending(root: Optional[str] = None) -> None:
    """Block until the background save to `root` (every root if None) is committed; re-raise its error."""
    keys = list(_pending) if root is None else [os.path.abspath(os.fspath(root))]
    for key in keys:
        pending = _pending.pop(key, None)
        if pending is not None:
            pending.wait()


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _rank_world(group=None):
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(obj, group=None) -> list:
    if _rank_world(group)[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj, group=None):
    """Rank 0's `obj` on every rank of `group`."""
    if _rank_world(group)[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _on_rank0(fn, group=None):
    """Run fn on rank 0 only; every rank raises if it failed (one broadcast, so none hangs)."""
    rank, world = _rank_world(group)
    error, message = None, None
    if rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            error, message = e, f"{type(e).__name__}: {e}"
    if world > 1:
        box = [message]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        message = box[0]
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"checkpoint save failed on rank 0: {message}")


def _layout() -> Dict[str, int]:
    ps = get_default_state()
    world = _rank_world()[1]
    return {"world": world, "dp": ps.dp_size if ps else world, "tp": ps.tp_size if ps else 1,
            "cp": ps.cp_size if ps else 1}


def _state_for_save(model, optimizer, step: int, extras: dict) -> dict:
    """The flat DCP state dict (collective under FSDP and for tp meshes: call on every rank)."""
    slots = model_slots(model)
    state = {s.key: s.chunk() for s in slots}
    if optimizer is not None:
        state.update(optim.state_for_save(model, optimizer, slots))
    rank = _rank_world()[0]
    state[f"{RNG_PREFIX}{rank}"] = to_blob(rng_state(model))
    if rank == 0:
        state[META_KEY] = to_blob(meta_for_save(step, extras, model, _layout()))
    return state


@contextlib.contextmanager
def _timed(times: Optional[Dict[str, float]], part: str) -> Iterator[None]:
    """Add the enclosed work's seconds to times[part] (nothing when times is None)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if times is not None:
            times[part] = times.get(part, 0.0) + time.perf_counter() - start


def _write_and_commit(state: dict, root: str, step: int, keep: int, config: Optional[dict], group,
                      times: Optional[Dict[str, float]] = None, direct_io: bool = True) -> str:
    """Write `state` to a unique root/.tmp-step_N-*, checksum it, rename it to root/step_N, update `latest`.
    `times` receives the seconds of "write" (DCP: planning, device-to-host copies, files written, hashed
    and fsync'd), "checksums" (each rank's hashes, any file not hashed while written read back, then one
    gather) and "commit" (rank 0)."""
    rank = _rank_world(group)[0]
    made = []
    _on_rank0(lambda: made.append(directory.prepare_tmp(root, step)), group)
    tmp = _broadcast(made[0] if made else None, group)  # its name is rank 0's (host, pid, random)
    with _timed(times, "write"):
        writer = dcp.FileSystemWriter(tmp, thread_count=writer_threads(state))
        with ShardFileSystem(direct=direct_io) as files:  # each file hashed as it is written (no second read)
            writer.fs = files
            dcp.save(state, storage_writer=writer, planner=ChunkSavePlanner(), process_group=group, no_dist=_no_dist())
    with _timed(times, "checksums"):
        try:
            mine = integrity.hash_files(tmp, integrity.own_files(tmp, rank), known=files.digests)
        except OSError as e:  # reported through rank 0, so no rank waits for a peer that gave up
            mine = f"rank {rank} could not checksum its files: {e}"
        gathered = _all_gather(mine, group)

    def finish():
        failed = [part for part in gathered if isinstance(part, str)]
        if failed:
            raise OSError("; ".join(failed))
        if config is not None:
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump(config, f, indent=1)
        integrity.write_manifest(tmp, integrity.complete_manifest(tmp, gathered), {"step": step})
        directory.commit(root, tmp, step, keep)

    with _timed(times, "commit"):
        _on_rank0(finish, group)
    return directory.step_dir(root, step)


def _agreed_step(root: str, step: Optional[int]) -> int:
    if step is not None:
        return step
    box = [directory.next_step(root) if _rank_world()[0] == 0 else None]
    if _rank_world()[1] > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def reserve_staging(staging: HostStaging, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    only_if_room: bool = False) -> bool:
    """Start allocating `staging`'s host buffers for the state a save of (model, optimizer) copies, in a
    background thread, so that the first save only copies (HostStaging.reserve). Call on every rank
    (the state dict is collective under FSDP), once the optimizer has its state. only_if_room: reserve
    only where the node has room for its ranks' copies (LOCAL_WORLD_SIZE of them in at most half of
    the available host memory). Returns whether it reserved."""
    if not isinstance(staging, HostStaging):
        raise TypeError(f"staging={staging!r} must be a tpflash.checkpoint.HostStaging (the one the saves get)")
    state = _state_for_save(model, optimizer, 0, {})
    if only_if_room and not fits_in_host_memory(state, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                                host_memory_available()):
        return False
    staging.reserve(state)
    return True


def save(root, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, step: Optional[int] = None,
         keep: int = 3, async_save: bool = False, staging: Optional[HostStaging] = None,
         times: Optional[Dict[str, float]] = None, direct_io: bool = True, **extra) -> str:
    """Save model, optimizer, RNG states and `extra` as root/step_<step>; return that path. Call on every rank.

    `step` None means one past the newest checkpoint. The save is atomic (see directory.py) and
    keeps the newest `keep` checkpoints (0: all). With `async_save` tensors are copied to host
    memory, then writing and committing continue in a background thread (on a dedicated gloo
    group) and the returned path (a str) has `.wait()`; the next save or load waits for it.
    `staging`: the tpflash.checkpoint.HostStaging whose buffers the state is copied into (one per run:
    pinned, reserved ahead (reserve_staging) and reused by every save). An async save without one makes
    a one-off pageable copy; a synchronous save with one copies the state there, then writes it through
    several threads per rank (without one: straight from the GPU, through one). `times` (a dict), if given,
    receives this rank's seconds per part of the save: "state" (the state dict, collective under
    FSDP), "staging" (the copy to host memory, where there is one), "write", "checksums" and "commit" (see
    _write_and_commit; for an async save, filled in by the background thread). `direct_io`: the files are
    written with direct I/O where the filesystem takes it (tpflash.checkpoint.shard_files); False sends
    them through the page cache (for a filesystem whose direct I/O is slow).
    """
    root = os.fspath(root)
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be an integer >= 0 (or None for the next one)")
    if not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep={keep!r} must be an integer >= 0 (0 keeps every checkpoint)")
    if not isinstance(direct_io, bool):
        raise ValueError(f"direct_io={direct_io!r} must be True or False")
    wait_pending(root)
    step = _agreed_step(root, step)
    with _timed(times, "state"):
        state = _state_for_save(model, optimizer, step, extra)
    config = model_config(model)
    if not async_save:
        if staging is not None:  # from host memory: written by WRITER_THREADS threads
            with _timed(times, "staging"):
                state = staging.stage(state)
        return _write_and_commit(state, root, step, keep, config, None, times, direct_io)
    group = async_group()
    staging = HostStaging(pinned=False) if staging is None else staging  # a one-off: pageable, freed after
    with _timed(times, "staging"):
        staged = staging.stage(state)
    pending = PendingSave(directory.step_dir(root, step))
    staging.read_by(pending)
    pending.start(lambda: _write_and_commit(staged, root, step, keep, config, group, times, direct_io))
    _pending[os.path.abspath(root)] = pending
    return pending


def _check_model_keys(slots, metadata: Metadata, path: str) -> None:
    """ValueError naming the first tensor whose shape differs, then missing/unexpected keys (no I/O)."""
    saved = metadata.state_dict_metadata
    for slot in slots:
        meta = saved.get(slot.key)
        if meta is not None and (not isinstance(meta, TensorStorageMetadata) or meta.size != slot.global_shape):
            found = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "a non-tensor"
            raise ValueError(f"shape mismatch for {slot.key[len(MODEL_PREFIX):]!r}: checkpoint {path} has "
                             f"{found}, the model has {tuple(slot.global_shape)}")
    keys = {s.key for s in slots}
    missing = [k[len(MODEL_PREFIX):] for k in keys - set(saved)]
    unexpected = [k[len(MODEL_PREFIX):] for k in saved if k.startswith(MODEL_PREFIX) and k not in keys]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")


def _agreed_path(root: str) -> str:
    """The checkpoint directory every rank resolved (one all_gather); the same error on every rank otherwise."""
    try:
        mine = directory.resolve(root)
    except FileNotFoundError as e:
        mine = e
    everyone = _all_gather(mine if isinstance(mine, str) else f"error: {mine}")
    if not isinstance(mine, str):
        raise mine
    errors = [p for p in everyone if p.startswith("error: ")]
    if errors:
        raise FileNotFoundError(f"another rank found no checkpoint: {errors[0][len('error: '):]}")
    if len(set(everyone)) > 1:
        raise RuntimeError(f"ranks resolved {root!r} to different checkpoints: {sorted(set(everyone))}")
    return mine


def load(root, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
         optimizer_state_of: Optional[Collection[str]] = None, **extra) -> dict:
    """Load a checkpoint (a step directory, or root's latest) into `model` (and `optimizer`) at any (dp, tp).

    Verifies every file's checksum first (CheckpointCorruptError on every rank, naming the
    file). The optimizer gets its state and its saved hyper-parameters (as torch's load_state_dict
    gives them), but keeps its own fused/foreach/capturable/differentiable settings: they belong
    to the device it runs on. `optimizer_state_of`: the names of the parameters whose optimizer state
    this rank keeps (a sharded optimizer's own, tpflash.parallel.ShardedOptimizerState.owned_names);
    None: every parameter's. Extras passed by name are restored in place; returns {"step": ..., other extras}.
    RNG states are restored when the world size equals the saving one. Call on every rank.
    """
    root = os.fspath(root)
    wait_pending(root)
    rank, world = _rank_world()
    path = _agreed_path(root)
    integrity.verify(path, rank, world, _all_gather if world > 1 else None)
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    slots = model_slots(model)
    _check_model_keys(slots, metadata, path)
    targets: Dict[str, object] = {s.key: s.chunk(zero_padding=True) for s in slots}  # views: loaded in place
    pending = None
    if optimizer is not None:
        if optim.GROUPS_KEY not in metadata.state_dict_metadata:
            raise ValueError(f"checkpoint {path} holds no optimizer state (saved without optimizer=)")
        opt_targets, pending = optim.load_targets(model, optimizer, slots, metadata, optimizer_state_of)
        targets.update(opt_targets)
    has_meta, rng_keys = split_meta_keys(metadata.state_dict_metadata)
    if not has_meta:
        raise integrity.CheckpointCorruptError(f"checkpoint {path} is corrupt: it has no '{META_KEY}' entry")
    targets[META_KEY] = None
    if rank in rng_keys:
        targets[rng_keys[rank]] = None
    with torch.no_grad():
        dcp.load(targets, storage_reader=reader, planner=ChunkLoadPlanner(), no_dist=_no_dist())
    if optimizer is not None:
        optim.apply_loaded(model, optimizer, targets, pending)
    meta, rng = _unpickle_agreed(path, targets, rng_keys.get(rank), world)
    if meta["layout"]["world"] == world and rng is not None:
        set_rng_state(rng, model)
    return restore_extras(meta, extra)


def _unpickle_agreed(path: str, targets: dict, rng_key: Optional[str], world: int):
    """(meta, this rank's RNG state or None), unpickled safely (blob.py); a refused entry on any rank
    raises the same UnsafeCheckpointError on every rank (RNG entries differ per rank)."""
    meta = rng = problem = None
    try:
        meta = from_blob(targets[META_KEY], f"{path}: entry {META_KEY!r}")
        rng = from_blob(targets[rng_key], f"{path}: entry {rng_key!r}") if rng_key is not None else None
    except UnsafeCheckpointError as e:
        problem = str(e)
    problems = [p for p in (_all_gather(problem) if world > 1 else [problem]) if p is not None]
    if problems:
        raise UnsafeCheckpointError(problems[0])
    return meta, rng
