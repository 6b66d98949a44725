"""The checkpoint root on disk: committed `step_N` directories, a `latest` pointer, atomic commits.

    root/
      step_100/          committed: complete, with manifest.json
      step_200/
      step_250.corrupt/  a step that failed verification at resume, moved aside (never deleted)
      .tmp-step_300-<host>-<pid>-<hex>/   a save in progress (or one that crashed)
      latest             text file naming the newest committed directory ("step_200")
      job.lock           the job that owns this root (lock.py)

A save writes into its own `.tmp-step_N-<host>-<pid>-<hex>` (a unique name: two writers never share
a temp), then one rename makes it `step_N`, then `latest` is replaced (a temp file, os.replace).
The newest committed directory with a manifest is the checkpoint (`latest()`); the pointer is
for people and tools, so a crash between the rename and the pointer update loses nothing.
A process removes only temps it made itself; the lock holder removes those of dead jobs
(`remove_tmps`). Only rank 0 touches the root.

Pruned and replaced steps are renamed to a temp of this process at once (`.tmp-old-step_N-...`) and
deleted by a background thread: unlinking a large checkpoint's files takes the filesystem tens of
seconds, which a save should not wait for. `wait_for_deletions()` joins those threads; a process that
dies first leaves temps of a dead pid, which the next lock holder removes.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import uuid
from typing import List, Optional, Tuple

STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
MANIFEST = "manifest.json"
CORRUPT_SUFFIX = ".corrupt"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_OWNER_RE = re.compile(r"^\.tmp-(?:old-)?(?:step_\d+|latest)-(.+)-(\d+)-[0-9a-f]{8}$")  # host, pid
_own_tmps = set()  # temps this process made and has not committed (a failed save's: removed by the next)
_deletions: List[threading.Thread] = []  # background deletions of pruned steps (delete_later)
_deletions_lock = threading.Lock()  # an async save's commit prunes from its own thread


def unique_suffix() -> str:
    """-<host>-<pid>-<random hex>: makes a temp name this process's alone."""
    return f"-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def directory_bytes(path: str) -> int:
    """The bytes of every file under `path` (0 if it does not exist)."""
    total = 0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(parent, name))
            except OSError:  # removed meanwhile (an older checkpoint pruned)
                pass
    return total


def step_dir(root: str, step: int) -> str:
    """The committed directory of step `step` under `root`."""
    return os.path.join(root, f"{STEP_PREFIX}{step}")


def tmp_dir(root: str, step: int) -> str:
    """A fresh unique path where a save of step `step` is written before the rename commits it."""
    return os.path.join(root, f"{TMP_PREFIX}{STEP_PREFIX}{step}{unique_suffix()}")


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
    """The newest committed checkpoint directory under `root` that has a manifest, or None.

    Not what the `latest` file names: a crash between a step's rename and the pointer update
    leaves the pointer one step behind a complete checkpoint.
    """
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
    """A new empty temporary directory for step's save, with a unique name. Temps of this process's
    own failed saves are removed; other temps may belong to a live writer and are left alone."""
    for old in list(_own_tmps):
        shutil.rmtree(old, ignore_errors=True)
        _own_tmps.discard(old)
    path = tmp_dir(root, step)
    os.makedirs(path)
    _own_tmps.add(path)
    return path


def _pid_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_dead_tmps(root: str, holder: Optional[Tuple[str, int]] = None) -> List[str]:
    """Remove the temps of dead writers: those named for a dead pid on this host, and those of
    `holder` (host, pid), a lock holder found gone. Returns their names; others are left alone."""
    if not os.path.isdir(root):
        return []
    host, removed = socket.gethostname(), []
    for name in sorted(os.listdir(root)):
        match = _TMP_OWNER_RE.match(name)
        if not name.startswith(TMP_PREFIX) or match is None:
            continue
        owner = (match.group(1), int(match.group(2)))
        if (holder is not None and owner == (holder[0], int(holder[1]))) or (owner[0] == host and _pid_dead(owner[1])):
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            removed.append(name)
    return removed


def quarantine(path: str) -> str:
    """Move a damaged step directory aside as step_N.corrupt (no longer a checkpoint, never pruned
    or overwritten, never deleted); returns the new path."""
    target, n = path + CORRUPT_SUFFIX, 1
    while os.path.exists(target):
        target, n = f"{path}{CORRUPT_SUFFIX}-{n}", n + 1
    os.rename(path, target)
    _fsync_dir(os.path.dirname(path) or ".")
    return target


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
    tmp = os.path.join(root, f"{TMP_PREFIX}{LATEST}{unique_suffix()}")
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
        delete_later(final)
    os.rename(tmp, final)
    _own_tmps.discard(tmp)
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
            delete_later(path)


def delete_later(path: str) -> None:
    """Take the directory `path` out of its root now (a rename to a temp of this process) and delete it
    in a background thread (module docstring)."""
    parent, name = os.path.split(path)
    doomed = os.path.join(parent, f"{TMP_PREFIX}old-{name}{unique_suffix()}")
    os.rename(path, doomed)
    _fsync_dir(parent)
    thread = threading.Thread(target=shutil.rmtree, args=(doomed, True), name=f"tpflash-delete:{name}", daemon=True)
    thread.start()
    with _deletions_lock:
        _deletions[:] = [t for t in _deletions if t.is_alive()] + [thread]


def wait_for_deletions() -> None:
    """Block until every directory given to delete_later is gone."""
    while True:
        with _deletions_lock:
            if not _deletions:
                return
            thread = _deletions.pop()
        thread.join()


def next_step(root: str) -> int:
    """The step number a save without `step=` gets: one past the newest committed, or 0."""
    steps = committed_steps(root)
    return steps[-1][0] + 1 if steps else 0
