"""Run a test body on N ranks: gloo on CPU, or NCCL with one GPU per rank (TPFLASH_TEST_BACKEND=nccl,
or automatically when N GPUs are visible).

Starting a process and importing torch costs seconds, so ranks are kept in a pool per world
size and reused across tests. A body is a module-level function (pickled by reference), run
on every rank as body(*args); it asserts what it checks. Any failure or timeout tears the pool
down (its collectives may be out of step) and the next test gets a fresh one.
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

TIMEOUT_S = float(os.environ.get("TPFLASH_TEST_TIMEOUT", "180"))
# Every process group a body builds (tpflash.parallel.init, FSDP meshes, ...) keeps gloo threads that
# wake every few milliseconds, and bodies never destroy their groups (the library may cache them), so a
# long-lived worker gathers hundreds of such threads: at a thousand, the four workers of a 4-rank pool
# burn a whole core while the pool sits idle and other tests run. A pool whose busiest worker has gained
# more than this many threads since its first body is replaced at its next use (a few seconds to start
# a fresh one).
MAX_GATHERED_THREADS = 200
GRACE_S = 10.0  # after a rank fails or its process dies: how long the others may still report


def backend_for(world_size: int) -> str:
    forced = os.environ.get("TPFLASH_TEST_BACKEND")
    if forced:
        return forced
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, store_file: str, backend: str, tasks, results) -> None:
    import datetime

    import torch.distributed as dist

    from tpflash.parallel.state import set_default_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A file store, not a TCP port: pools start side by side and a probed "free" port can be taken
    # between the probe and the bind. MASTER_PORT stays set for code that reads it.
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # noqa: BLE001 - report everything, the driver decides
            results.put((rank, False, traceback.format_exc()))
        finally:
            set_default_state(None)
    dist.destroy_process_group()


class RankPool:
    """world_size processes with an initialised default process group, waiting for bodies to run."""

    def __init__(self, world_size: int, backend: Optional[str] = None):
        self.world_size = world_size
        self.backend = backend or backend_for(world_size)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._store_dir = tempfile.mkdtemp(prefix="tpflash-pool-")
        store_file = os.path.join(self._store_dir, "store")
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, store_file, self.backend, self.tasks[r],
                                                        self.results), daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.broken = False
        self._first_threads: Optional[int] = None  # the busiest worker's threads after the first body

    def run(self, fn: Callable, *args, timeout: float = TIMEOUT_S) -> List:
        """Run fn(*args) on every rank; return the per-rank results, or raise with every rank's traceback
        and, for a rank that never reported, whether its process died (and how) or still runs."""
        for q in self.tasks:
            q.put((fn, args))
        got: Dict[int, tuple] = {}
        give_up = time.monotonic() + timeout
        while len(got) < self.world_size and time.monotonic() < give_up:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                waiting = [p.is_alive() for r, p in enumerate(self.procs) if r not in got]
                if not any(waiting):
                    break  # every rank left to report has died
                if not all(waiting):
                    give_up = min(give_up, time.monotonic() + GRACE_S)  # its peers may wait on it forever
                continue
            got[rank] = (ok, value)
            if not ok:
                give_up = min(give_up, time.monotonic() + GRACE_S)  # peers may be stuck in a collective it left
        failures = {r: v for r, (ok, v) in got.items() if not ok}
        missing = sorted(set(range(self.world_size)) - set(got))
        if failures or missing:
            self.broken = True
            lines = [f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())]
            lines += [f"rank {r} did not finish: {self._fate(r)}" for r in missing]
            raise AssertionError(f"{fn.__name__} failed on {self.world_size} ranks ({self.backend}):\n"
                                 + "\n".join(lines))
        if self._first_threads is None:
            self._first_threads = self._worker_threads()
        return [got[r][1] for r in range(self.world_size)]

    def _fate(self, rank: int) -> str:
        """How rank's worker process stands: still running (hung, or slower than the timeout), or how it ended."""
        code = self.procs[rank].exitcode
        if code is None:
            return "its process still runs (hung, or slower than the timeout)"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"its process was killed by {name}"
        return f"its process exited with code {code}"

    def _worker_threads(self) -> int:
        """The most threads any worker has (0 where /proc cannot tell)."""
        most = 0
        for p in self.procs:
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    most = max(most, next(int(line.split()[1]) for line in f if line.startswith("Threads:")))
            except (OSError, StopIteration, ValueError):
                pass
        return most

    def gathered_threads(self) -> int:
        """Threads the busiest worker has gained since its first body (see MAX_GATHERED_THREADS)."""
        return 0 if self._first_threads is None else self._worker_threads() - self._first_threads

    def close(self, kill: bool = False) -> None:
        """Stop the workers: let them leave their process groups and exit, or (kill, or a broken pool)
        kill them."""
        if not (self.broken or kill):
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self._store_dir, ignore_errors=True)


class PoolCache:
    """One live RankPool per (world size, backend); a broken pool, or one that has gathered too many
    threads (MAX_GATHERED_THREADS), is replaced on next use."""

    def __init__(self):
        self.pools: Dict[Tuple[int, str], RankPool] = {}
        self.backend: Optional[str] = None  # None: backend_for(world_size); set per test by conftest.py

    def __call__(self, world_size: int) -> RankPool:
        key = (world_size, self.backend or backend_for(world_size))
        pool = self.pools.get(key)
        if pool is None or pool.broken or pool.gathered_threads() > MAX_GATHERED_THREADS:
            if pool is not None:
                pool.close(kill=True)  # nothing in it is worth a clean exit
            pool = self.pools[key] = RankPool(world_size, key[1])
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
