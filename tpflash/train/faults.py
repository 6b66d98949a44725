"""Stopping cleanly on SIGTERM, and the fault-injection hook used by the elastic tests.

TPFLASH_FAULT (read only here, only by the trainer) makes one rank SIGKILL itself once:
  kill_at_step:N   right after optimizer step N, before any checkpoint of step N is written;
  kill_in_save:N   while the checkpoint of step N is being written (after its first file
                   appears under checkpoint.dir), so the save never commits.
The rank is TPFLASH_FAULT_RANK (default: the last rank). It fires only in the first attempt
(TORCHELASTIC_RESTART_COUNT 0 or unset), so the job restarted by `torchrun --max-restarts`
runs through.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional, Set

import torch
import torch.distributed as dist


class Fault:
    """The parsed TPFLASH_FAULT for this rank (or kind None: nothing to do)."""

    def __init__(self, rank: int, world_size: int, spec: Optional[str] = None):
        spec = os.environ.get("TPFLASH_FAULT", "") if spec is None else spec
        self.kind, self.step = None, -1
        if not spec:
            return
        kind, _, step = spec.partition(":")
        if kind not in ("kill_at_step", "kill_in_save") or not step.isdigit():
            raise ValueError(f"TPFLASH_FAULT={spec!r}: expected kill_at_step:N or kill_in_save:N")
        target = int(os.environ.get("TPFLASH_FAULT_RANK", world_size - 1))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if rank == target and first_attempt:
            self.kind, self.step = kind, int(step)

    def after_step(self, step: int) -> None:
        if self.kind == "kill_at_step" and step == self.step:
            _die(f"kill_at_step:{step}")

    @contextmanager
    def around_save(self, step: int, root: str) -> Iterator[None]:
        """Kill this process as soon as the save of `step` has written its first new file."""
        if self.kind != "kill_in_save" or step != self.step:
            yield
            return
        before = _files(root)
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                if _files(root) - before:
                    _die(f"kill_in_save:{step}")
                time.sleep(0.0005)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()


def _files(root: str) -> Set[str]:
    found = set()
    for dirpath, _, names in os.walk(root):
        found.update(os.path.join(dirpath, n) for n in names)
    return found


def _die(why: str) -> None:
    print(f"[tpflash fault] rank {os.environ.get('RANK', '?')}: {why}: SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class StopSignal:
    """Records SIGTERM (as sent by torchrun, schedulers and preemption); `agreed()` tells every rank
    whether any rank got one, so all of them save at the same step and exit."""

    def __init__(self, device: torch.device):
        self.device, self.received = device, False
        self._old = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        """Collective over the default group: True when any rank has received SIGTERM."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._old)
