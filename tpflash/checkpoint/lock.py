"""One job per checkpoint directory: `root/job.lock`, held for the job's lifetime.

Two jobs writing one root would prune each other's checkpoints and resume from each other's
steps. The lock file names its holder (host, pid, start time) and carries a heartbeat that a
daemon thread refreshes every HEARTBEAT_S seconds. A second job is refused with
CheckpointLockedError naming the holder. A stale lock (heartbeat older than STALE_S, or on this
host with a dead pid) is taken over with a warning, and the dead holder's temps are removed.

Creation is atomic: the record is written to a unique temp file, then `os.link`ed to job.lock
(fails if it exists), so a reader never sees half a record and exactly one of two racing jobs
wins. A takeover replaces the file under a second exclusive file (job.lock.takeover), so two
jobs that both judge a lock stale cannot both take it.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import uuid
import warnings
from typing import Callable, Optional

from . import directory

LOCK_FILE = "job.lock"
HEARTBEAT_S = 15.0
STALE_S = 120.0  # 8 missed heartbeats: the holder is gone (or its filesystem is)
_TAKEOVER_STALE_S = 30.0  # a takeover mutex left by a crash inside the few lines that hold it


class CheckpointLockedError(ValueError):
    """Another live job holds the checkpoint directory's lock."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_tmp(path: str, record: dict) -> str:
    tmp = path + directory.unique_suffix()
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _link_exclusive(path: str, record: dict) -> bool:
    """Create `path` holding `record` atomically; False if it already exists."""
    tmp = _write_tmp(path, record)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)


def describe(holder: dict) -> str:
    age = time.time() - float(holder.get("heartbeat", 0))
    return (f"host {holder.get('host')} pid {holder.get('pid')}, started {holder.get('started')}, "
            f"last heartbeat {age:.0f}s ago")


def stale_reason(holder: dict, stale_s: float) -> Optional[str]:
    """Why the holder is gone (None: it may be alive)."""
    if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
        return "its process has exited"
    if time.time() - float(holder.get("heartbeat", 0)) > stale_s:
        return f"its heartbeat is older than {stale_s:.0f}s"
    return None


class DirLock:
    """A held lock; `release()` (also at exit) removes the file if it is still ours."""

    def __init__(self, root: str, record: dict, heartbeat_s: float):
        self.root, self.record = root, record
        self.path = os.path.join(root, LOCK_FILE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                        name=f"tpflash-lock:{root}")
        self._thread.start()
        atexit.register(self.release)

    def held(self) -> bool:
        current = _read(self.path)
        return current is not None and current.get("token") == self.record["token"]

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            if not self.held():
                warnings.warn(f"the lock {self.path} was taken over by another job; this job no longer owns "
                              f"{self.root}")
                return
            self.record["heartbeat"] = time.time()
            os.replace(_write_tmp(self.path, self.record), self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.held():
            os.remove(self.path)
        _held.pop(os.path.abspath(self.root), None)


_held = {}  # abspath(root) -> this process's DirLock


def acquire(root: str, heartbeat_s: float = HEARTBEAT_S, stale_s: float = STALE_S,
            warn: Callable[[str], None] = warnings.warn) -> DirLock:
    """Take root's lock for this process, or raise CheckpointLockedError naming the live holder.

    A lock this process already holds (an earlier run in the same process) is handed over to the new
    holder object.
    """
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_FILE)
    now = time.time()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
              "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)), "heartbeat": now}
    previous = _held.pop(os.path.abspath(root), None)
    if previous is not None:
        previous.release()
    for _ in range(50):
        if _link_exclusive(path, record):
            break
        holder = _read(path)
        if holder is None:  # removed meanwhile (a release): try again
            time.sleep(0.01)
            continue
        why = stale_reason(holder, stale_s)
        if why is None:
            raise CheckpointLockedError(
                f"checkpoint directory {root} is in use by another job ({describe(holder)}); one job per "
                f"checkpoint.dir: stop that job or choose another dir (a lock whose heartbeat is older than "
                f"{stale_s:.0f}s is taken over)")
        if _take_over(path, holder, record):
            removed = directory.remove_dead_tmps(root, (holder.get("host"), holder.get("pid")))
            warn(f"took over the lock of {root} from a job that is gone ({describe(holder)}: {why})"
                 + (f"; removed its temps {removed}" if removed else ""))
            break
        time.sleep(0.01)
    else:
        raise CheckpointLockedError(f"could not take the lock {path}: other jobs keep changing it")
    lock = DirLock(root, record, heartbeat_s)
    _held[os.path.abspath(root)] = lock
    return lock


def _take_over(path: str, stale: dict, record: dict) -> bool:
    """Replace the stale holder's record by ours, unless someone else got there first."""
    mutex = path + ".takeover"
    if not _link_exclusive(mutex, record):
        try:  # left by a crash between the two lines below: remove it, then let the caller retry
            if time.time() - os.path.getmtime(mutex) > _TAKEOVER_STALE_S:
                os.remove(mutex)
        except OSError:
            pass
        return False
    try:
        current = _read(path)
        if current is None or current.get("token") != stale.get("token"):
            return False  # released or taken over meanwhile: the caller looks again
        os.replace(_write_tmp(path, record), path)
        return True
    finally:
        os.remove(mutex)
