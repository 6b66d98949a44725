"""The checkpoint root on disk: committed `step_N` directories, a `latest` pointer, atomic commits.

    root/
      step_100/          committed: complete, with manifest.json
      step_200/
      .tmp-step_300/     a save in progress (or one that crashed: ignored, removed by the next save)
      latest             text file naming the newest committed directory ("step_200")

A save writes into `.tmp-step_N`, then one rename makes it `step_N`, then `latest` is replaced
(write a temp file, os.replace). A crash at any point leaves `latest` naming a complete
checkpoint. Only rank 0 touches the root; the other ranks wait at a barrier.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import List, Optional, Tuple

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    """The committed directory of step `step` under `root`."""
    return os.path.join(root, f"{STEP_PREFIX}{step}")


def tmp_dir(root: str, step: int) -> str:
    """Where a save of step `step` is written before the rename commits it."""
    return os.path.join(root, f"{TMP_PREFIX}{STEP_PREFIX}{step}")


def committed_steps(root: str) -> List[Tuple[int, str]]:
    """(step, path) of every committed checkpoint under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_RE.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest(root: str) -> Optional[str]:
    """The newest committed checkpoint directory under `root` (what `latest` names), or None.

    Without a `latest` file (a crash between the first commit and its pointer) the newest
    committed directory with a manifest is returned.
    """
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if name and os.path.isdir(path):
            return path
    for _, path in reversed(committed_steps(root)):
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return path
    return None


def is_checkpoint_dir(path: str) -> bool:
    """Whether `path` is one checkpoint (it has a manifest or DCP metadata), not a root of several."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, ".metadata"))


def resolve(path: str) -> str:
    """A checkpoint directory from either a step directory or a root (its latest). FileNotFoundError if none."""
    if is_checkpoint_dir(path):
        return path
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {path!r} (no committed step_N directory and no 'latest')")
    return found


def prepare_tmp(root: str, step: int) -> str:
    """An empty temporary directory for step's save (a stale one from a crashed save is removed)."""
    path = tmp_dir(root, step)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_latest(root: str, name: str) -> None:
    """Point `latest` at `name` atomically (temp file + os.replace)."""
    tmp = os.path.join(root, f"{TMP_PREFIX}{LATEST}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def commit(root: str, tmp: str, step: int, keep: int) -> str:
    """Rename `tmp` to step_N (replacing an older step_N), update `latest`, keep the newest `keep`."""
    final = step_dir(root, step)
    _fsync_dir(tmp)
    if os.path.exists(final):  # re-saving a step (e.g. after a restart): move the old one aside first
        old = os.path.join(root, f"{TMP_PREFIX}old-{STEP_PREFIX}{step}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    write_latest(root, os.path.basename(final))
    prune(root, keep, protect=final)
    return final


def prune(root: str, keep: int, protect: Optional[str] = None) -> None:
    """Delete all but the newest `keep` committed checkpoints (never `protect`); keep <= 0 keeps all."""
    if keep <= 0:
        return
    steps = committed_steps(root)
    for _, path in steps[:max(0, len(steps) - keep)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)


def next_step(root: str) -> int:
    """The step number a save without `step=` gets: one past the newest committed, or 0."""
    steps = committed_steps(root)
    return steps[-1][0] + 1 if steps else 0
