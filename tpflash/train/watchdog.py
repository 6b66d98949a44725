"""Hangs name themselves: a rank that waits for the others longer than `dist.timeout` fails the job with
one line naming the ranks that did not arrive, the operation, its group and the step.

The loop tells a `HangWatch` where it is (`begin_step`, `enter(phase)`: attribute writes, a few per
step). A daemon thread per rank wakes every `beat` seconds, publishes a heartbeat (its step and phase)
to the job's store, and checks how long the main thread has been in its phase. Past the phase's
allowance (`dist.timeout`; `dist.long_timeout` for start-up, the run's first step, evaluations and
saves) the rank has waited too long: it dumps its flight recorder, and the first rank to get there
(an atomic counter in the store) reads every rank's heartbeat twice, a window apart. Ranks whose
heartbeat did not move are silent (a stopped process, a stuck host); else ranks whose phase count is
behind the others' are late. It prints the line, SIGKILLs silent ranks on its own host (torchrun
would wait 30 s for them, also before a restart), and every detecting rank exits with
TIMEOUT_STATUS, so `torchrun --max-restarts` restarts the job from its last checkpoint.

The operation and group come from this rank's flight recorder (torch's record of its collectives,
on gloo and NCCL alike): its oldest unfinished collective. Process groups keep their own timeouts as
a backstop, set a margin above the allowance, so that this thread reports first.
"""
from __future__ import annotations

import collections
import os
import pickle
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..parallel.state import set_group_timeouts

TIMEOUT_STATUS = 3  # the exit status of every rank that timed out (non-zero: torchrun restarts the job)

PHASES = {  # phase -> how the line names it
    "start": "start-up", "forward": "the forward", "backward": "the backward",
    "gradients": "the gradient reduction", "norm": "the gradient norm", "optimizer": "the optimizer step",
    "log": "a log step's loss average", "vote": "the stop vote", "eval": "an evaluation",
    "save": "a checkpoint save", "export": "the Hugging Face export",
}
LONG_PHASES = frozenset({"start", "eval", "save", "export"})


def beat_interval(timeout: float) -> float:
    """Seconds between heartbeats (and checks): timeout/20, within [0.1, 5]."""
    return min(5.0, max(0.1, timeout / 20))


def group_timeout(allowance: float, timeout: float) -> float:
    """The process groups' backstop timeout for a phase allowed `allowance` seconds: late enough that
    the watch has reported (a beat to notice, a window of heartbeats, the store) before it fires."""
    return allowance + 10.0 + 10 * beat_interval(timeout)


def flight_recorder_setup(log_dir: str, use_cuda: bool) -> str:
    """The path prefix of the flight-recorder dumps (rank appended): TORCH_FR_DUMP_TEMP_FILE (or the
    older TORCH_NCCL_DEBUG_INFO_TEMP_FILE) when set, else log_dir/flight_recorder/rank_ (without
    log_dir, torch's default /tmp/nccl_trace_rank_). Unless the environment says otherwise, NCCL is
    also asked to record 2000 collectives and to dump them there on its own timeouts. Call before
    the process group exists."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        prefix = os.path.join(log_dir, "flight_recorder", "rank_") if log_dir else "/tmp/nccl_trace_rank_"
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    if not (os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")):
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if use_cuda:  # NCCL's own dump does not make the directory
        os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    return prefix


def rank_list(ranks: Sequence[int]) -> str:
    """"rank 1", "ranks 0-3" or "ranks 0, 2"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class HangWatch:
    """One per rank. `begin_step` and `enter` are for the main thread (cheap, watched or not); `start()`
    begins the checks on a daemon thread (none in a world of one) and `close()` ends them."""

    def __init__(self, timeout: float, long_timeout: float, groups: Dict[str, dist.ProcessGroup],
                 trace_prefix: str, on_exit: Sequence[Callable[[], None]] = ()):
        self.timeout, self.long_timeout, self.trace_prefix = timeout, long_timeout, trace_prefix
        self.beat = beat_interval(timeout)
        self.on_exit = list(on_exit)
        self.step, self.first_step, self.phase, self.marks = 0, None, "start", 0
        self._since, self._long, self._started_ns, self._store = time.monotonic(), True, 0, None
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # the groups by name (a group that serves several roles keeps the last: tp over world)
        self.groups = {g.group_name: (label, dist.get_process_group_ranks(g)) for label, g in groups.items()
                       if g is not None}
        self._history = collections.deque(maxlen=64)  # (wall ns, step, phase) of the last phases entered
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> None:
        """Start watching (a world of one has no one to wait for: nothing starts)."""
        if self.world > 1 and self._thread is None:
            set_group_timeouts(group_timeout(self.long_timeout, self.timeout))
            self._store, self._long, self._started_ns = _store(), True, time.time_ns()
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="tpflash-hang-watch", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ main thread
    def begin_step(self, step: int) -> None:
        """Step `step` (1-based) begins (its phases follow)."""
        self.step = step
        if self.first_step is None:
            self.first_step = step

    def enter(self, phase: str) -> None:
        """The main thread moves on to `phase` (a PHASES key): its wait is measured from here."""
        self.phase, self.marks, self._since = phase, self.marks + 1, time.monotonic()
        self._history.append((time.time_ns(), self.step, phase))  # which step and phase issued a collective
        long = phase in LONG_PHASES or self.step == self.first_step
        if long != self._long and self._thread is not None:
            set_group_timeouts(group_timeout(self.long_timeout if long else self.timeout, self.timeout))
        self._long = long

    def close(self) -> None:
        """Stop watching (the end of the run, or an error in it); the groups get the long backstop back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            set_group_timeouts(group_timeout(self.long_timeout, self.timeout))
            self._thread = None

    # ------------------------------------------------------------ the watching thread
    def _watch(self) -> None:
        store, self._beats = self._store, 0
        try:  # every rank adds before its run's first collective, so all of them get the same number
            store = dist.PrefixStore(f"run_{(store.add('runs', 1) - 1) // self.world}/", store)
        except Exception:  # noqa: BLE001 - no store: the checks go on, without heartbeats
            store = None
        while True:
            self._beat(store)
            allowance = self.long_timeout if self._long else self.timeout
            waited = time.monotonic() - self._since
            if waited > allowance:
                self._fail(store, waited, allowance)
            if self._stop.wait(self.beat):
                return

    def _beat(self, store: Optional[dist.Store]) -> None:
        """Publish "count step marks phase pid host" (a store that does not answer is skipped)."""
        self._beats += 1
        _quietly(lambda: store.set(f"beat/{self.rank}", f"{self._beats} {self.step} {self.marks} {self.phase} "
                                                        f"{os.getpid()} {socket.gethostname()}"))

    def _fail(self, store: dist.Store, waited: float, allowance: float) -> None:
        waited, where = self._where(waited)
        try:
            reporter = store.add("timed_out", 1) == 1
        except Exception:  # noqa: BLE001 - no store: every rank that timed out says so itself
            reporter, store = True, None
        window = max(1.0, 3 * self.beat)  # for heartbeats to show who is silent
        if reporter:
            try:
                missing = self._missing(store, window) if store is not None else "the job's store did not answer"
            except Exception as e:  # noqa: BLE001
                missing = f"the job's store did not answer ({type(e).__name__})"
            which = "dist.long_timeout" if allowance == self.long_timeout else "dist.timeout"
            print(f"error: timed out: {missing}; rank {self.rank} waited {waited:.1f} s ({which} {allowance:g} s) "
                  f"{where}; flight recorder dumps: {self.trace_prefix}<rank>", file=sys.stderr, flush=True)
            if store is not None:
                _quietly(lambda: store.set("reported", "1"))
        else:  # beating on (silent ranks are the ones named), until the reporter's line is out
            deadline = time.monotonic() + window + 15
            while time.monotonic() < deadline and not _has(store, "reported"):
                self._beat(store)
                time.sleep(self.beat)
        for fn in self.on_exit:
            _quietly(fn)
        sys.stdout.flush()
        os._exit(TIMEOUT_STATUS)

    def _missing(self, store: dist.Store, window: float) -> str:
        """Who did not arrive: silent ranks (heartbeat unchanged over `window` seconds; those on this host
        are SIGKILLed), else alive ranks behind the others, as text."""
        first = _beats(store, self.world)
        time.sleep(window)
        last = _beats(store, self.world)
        silent = [r for r in range(self.world) if r != self.rank and (last[r] is None or last[r] == first[r])]
        if silent:
            host, killed = socket.gethostname(), []
            for r in silent:
                if last[r] is not None and last[r][5] == host and int(last[r][4]) != os.getpid():
                    _quietly(lambda: os.kill(int(last[r][4]), signal.SIGKILL))
                    killed.append(r)
            seen = [f"rank {r}'s last heartbeat at step {last[r][1]}, {PHASES.get(last[r][3], last[r][3])}"
                    for r in silent if last[r] is not None]
            seen = seen[:3] + (["..."] if len(seen) > 3 else [])
            return (f"{rank_list(silent)} did not arrive (silent for {window:.1f} s: stopped, or a stuck host"
                    + "".join(f"; {text}" for text in seen) + (f"; SIGKILLed {rank_list(killed)}" if killed else "")
                    + ")")
        marks = {r: int(b[2]) for r, b in enumerate(last) if b is not None}
        behind = [r for r, m in marks.items() if m < max(marks.values())]
        if behind:
            at = "; ".join(f"rank {r} at step {last[r][1]}, {PHASES.get(last[r][3], last[r][3])}"
                           for r in behind[:3]) + ("; ..." if len(behind) > 3 else "")
            return f"{rank_list(behind)} did not arrive (alive, behind the others: {at})"
        return ("no rank is behind on the host (every rank waits: a stall on the device, or collectives "
                "issued in different orders: compare the ranks' flight recorders)")

    def _where(self, waited: float) -> Tuple[float, str]:
        """Write this rank's flight recorder to trace_prefix<rank>; (seconds waited, where) as "in all_reduce
        #12 over tp (ranks 0-1) in the forward of step 3": its oldest unfinished collective, the step and
        phase that issued it, and where the host is when that differs; without the collective where
        there is none or no recorder."""
        host = (self.step, self.phase)
        text = f"in {PHASES.get(self.phase, self.phase)} of step {self.step}"
        data = _flight_recorder("nccl" in str(dist.get_backend()))
        if data is None:
            return waited, text
        _quietly(lambda: _write(f"{self.trace_prefix}{self.rank}", data))
        try:
            entries = [e for e in pickle.loads(data).get("entries", []) if not e.get("retired", True)
                       and e.get("time_created_ns", 0) >= self._started_ns]  # not, e.g., a CUDA graph's capture
        except Exception:  # noqa: BLE001
            entries = []
        if not entries:
            return waited, text
        e = min(entries, key=lambda e: e.get("time_created_ns", 0))
        op = str(e.get("profiling_name", "a collective")).split(":")[-1]
        seq = e.get("p2p_seq_id") if e.get("is_p2p") else e.get("collective_seq_id")
        name, desc = (tuple(e.get("process_group", ("?", "?"))) + ("?", "?"))[:2]
        label, ranks = self.groups.get(name, (f"group {desc or name}", None))
        created = e.get("time_created_ns", 0)
        issued = [(step, phase) for t, step, phase in list(self._history) if t <= created][-1:] or [host]
        step, phase = issued[0]
        text = f"in {op} #{seq} over {label}" + (f" ({rank_list(ranks)})" if ranks else "") + \
            f" in {PHASES.get(phase, phase)} of step {step}"
        if (step, phase) != host:  # on CUDA the host runs ahead of the device
            text += f" (the host waits in {PHASES.get(self.phase, self.phase)} of step {self.step})"
        return max(waited, (time.time_ns() - created) / 1e9), text


def _store() -> Optional[dist.Store]:
    """The watch's store: the default group's, through a connection of its own with a short timeout
    where it is a TCPStore (whose server may be a stopped rank's), keys apart per torchrun attempt;
    None if it cannot be reached."""
    store = inner = dist.distributed_c10d._get_default_store()
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    try:
        if isinstance(inner, dist.TCPStore):
            store = dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=10),
                                  wait_for_workers=False)
    except Exception:  # noqa: BLE001
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return dist.PrefixStore("tpflash/watch/" + (f"attempt_{restart}/" if restart is not None else ""), store)


def _beats(store: dist.Store, world: int) -> List[Optional[Tuple[str, ...]]]:
    """Every rank's heartbeat (count, step, marks, phase, pid, host), None where there is none."""
    out = []
    for r in range(world):
        key = f"beat/{r}"
        out.append(tuple(store.get(key).decode().split(" ")) if store.check([key]) else None)
    return out


def _has(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001
        return True  # nothing to wait for


def _flight_recorder(nccl: bool) -> Optional[bytes]:
    """This process's flight recorder, pickled: NCCL's for an NCCL job, else the one gloo records into."""
    for name in ("_dump_nccl_trace", "_dump_fr_trace") if nccl else ("_dump_fr_trace",):
        fn = getattr(torch._C._distributed_c10d, name, None)
        try:
            return fn()
        except Exception:  # noqa: BLE001 - absent from this build, or failing: the next, else none
            continue
    return None


def trainer_groups(ps) -> Dict[str, dist.ProcessGroup]:
    """A ParallelState's groups by the names the line uses; a group in several roles is named by the
    last (tp over world, dp over dp_cp at cp=1)."""
    return {"world": dist.group.WORLD, "dp_cp": ps.dp_cp_group, "dp": ps.dp_group, "cp": ps.cp_group,
            "tp": ps.tp_group}


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the job is failing anyway: say what can be said, then exit
        pass
