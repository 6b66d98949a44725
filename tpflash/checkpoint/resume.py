"""What a job does with its checkpoint directory at start-up, agreed by every rank.

`claim(root)`: rank 0 takes the directory's lock (lock.py); every rank raises the same
CheckpointLockedError if it is held. `resume_point(root, on_corrupt)`: the step directory to
resume from, or None to start over. Each rank lists the committed steps it sees; if the lists
differ (a directory that is not shared, a stale NFS view) every rank raises
CheckpointDirMismatchError naming what each sees, before any rank starts a collective load
that the others would never join. Then the newest committed step is verified (sizes and
checksums, one collective); a damaged one is moved aside as step_N.corrupt with a warning and
the next older is tried (`on_corrupt="fallback"`), or CheckpointCorruptError is raised
(`on_corrupt="error"`). The `latest` pointer is not consulted: a crash between a step's
rename and the pointer update leaves a newer complete step, which is the one to resume.
"""
from __future__ import annotations

import os
import warnings
from typing import List, Optional

import torch.distributed as dist

from . import directory, integrity
from .lock import CheckpointLockedError, DirLock, acquire

ON_CORRUPT = ("fallback", "error")


class CheckpointDirMismatchError(ValueError):
    """The ranks of one job see different checkpoints in the same directory."""


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj) -> list:
    if _rank_world()[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def claim(root: str, warn=None) -> Optional[DirLock]:
    """Rank 0 takes root's lock (returned there; None elsewhere). CheckpointLockedError on every rank if
    another job holds it. Collective: every rank calls it."""
    rank = _rank_world()[0]
    lock, error = None, None
    if rank == 0:
        try:
            lock = acquire(root, warn=warn or warnings.warn)
        except (CheckpointLockedError, OSError) as e:
            error = f"{e}"
    errors = [e for e in _all_gather(error) if e is not None]
    if errors:
        raise CheckpointLockedError(errors[0])
    return lock


def _describe_view(steps: List[str]) -> str:
    return steps[-1] if steps else "no checkpoint"


def agreed_steps(root: str) -> List[str]:
    """The committed step directory names every rank sees (oldest first); CheckpointDirMismatchError
    on every rank if they differ."""
    mine = [os.path.basename(p) for _, p in directory.committed_steps(root)]
    gathered = _all_gather((root, mine))  # with rank 0's root, so that every rank raises the same line
    views = [view for _, view in gathered]
    if any(v != views[0] for v in views):
        by_view = {}
        for rank, view in enumerate(views):
            by_view.setdefault(tuple(view), []).append(rank)
        parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} see{'' if len(r) > 1 else 's'} "
                 f"{_describe_view(list(v))} ({len(v)} steps)" for v, r in by_view.items()]
        raise CheckpointDirMismatchError(
            f"{'; '.join(parts)} in {gathered[0][0]}: the ranks must see the same checkpoint directory (a shared filesystem)")
    return mine


def resume_point(root: str, on_corrupt: str = "fallback", warn=None) -> Optional[str]:
    """The newest committed, verified step directory under root (agreed by every rank), or None if
    there is none. Collective. See the module docstring for `on_corrupt`."""
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt={on_corrupt!r} must be one of {ON_CORRUPT}")
    warn = warn or warnings.warn
    rank, world = _rank_world()
    names = agreed_steps(root)
    bad = []
    for name in reversed(names):
        path = os.path.join(root, name)
        try:
            integrity.verify(path, rank, world, _all_gather if world > 1 else None)
        except integrity.CheckpointCorruptError as e:
            if on_corrupt == "error":
                raise integrity.CheckpointCorruptError(
                    f"{e}; checkpoint.on_corrupt=error: not falling back to an older step") from None
            moved = _quarantine(path) if rank == 0 else None
            moved = _all_gather(moved)[0]
            warn(f"skipping {name}: {e}; moved it to {moved} (kept, never deleted) and trying the step before")
            bad.append(name)
            continue
        return path
    if bad:
        raise integrity.CheckpointCorruptError(
            f"no intact checkpoint in {root}: every step ({', '.join(bad)}) failed verification and was moved "
            f"aside as *.corrupt; starting over would discard them, so move or fix them, or set "
            f"checkpoint.resume=false")
    return None


def _quarantine(path: str) -> str:
    try:
        return directory.quarantine(path)
    except OSError as e:  # still reported on every rank through the warning; the step is then skipped
        return f"(nowhere: {e})"
