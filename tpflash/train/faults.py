"""Stopping cleanly on SIGTERM, and the fault-injection hook used by the elastic tests.

TPFLASH_FAULT (read only here, only by the trainer) makes one rank fail once:
  kill_at_step:N   SIGKILL right after optimizer step N, before any checkpoint of step N is written;
  kill_in_save:N   SIGKILL while the checkpoint of step N is being written (after its first file
                   appears under checkpoint.dir), so the save never commits;
  stall_at_step:N  SIGSTOP as step N begins: the process is alive but silent, and the others wait
                   for it in their first collective of step N (tpflash.train.watchdog names it);
  term_at_step:N   SIGTERM to itself right after optimizer step N, as a scheduler's preemption
                   would send it (StopSignal: every rank saves at the same step and exits 0).
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


KINDS = ("kill_at_step", "kill_in_save", "stall_at_step", "term_at_step")


class Fault:
    """The parsed TPFLASH_FAULT for this rank (or kind None: nothing to do)."""

    def __init__(self, rank: int, world_size: int, spec: Optional[str] = None):
        spec = os.environ.get("TPFLASH_FAULT", "") if spec is None else spec
        self.kind, self.step = None, -1
        if not spec:
            return
        kind, _, step = spec.partition(":")
        if kind not in KINDS or not step.isdigit():
            raise ValueError(f"TPFLASH_FAULT={spec!r}: expected {', '.join(k + ':N' for k in KINDS)}")
        target = int(os.environ.get("TPFLASH_FAULT_RANK", world_size - 1))
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if rank == target and first_attempt:
            self.kind, self.step = kind, int(step)

    def before_step(self, step: int) -> None:
        """Called as step `step` begins (before its first collective)."""
        if self.kind == "stall_at_step" and step == self.step:
            print(f"[tpflash fault] rank {os.environ.get('RANK', '?')}: stall_at_step:{step}: SIGSTOP pid "
                  f"{os.getpid()} at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def after_step(self, step: int) -> None:
        if self.kind == "kill_at_step" and step == self.step:
            _die(f"kill_at_step:{step}")
        if self.kind == "term_at_step" and step == self.step:
            print(f"[tpflash fault] rank {os.environ.get('RANK', '?')}: term_at_step:{step}: SIGTERM", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

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
    whether any rank got one, so all of them save at the same step and exit.

    The answer never makes the host wait for the GPU to finish the step it has just issued: with
    one process it is the flag itself, and over several it is the all-reduce issued at the previous
    call, read through pinned memory once that call's step has run. So a SIGTERM stops training one
    step later than it would with a blocking all-reduce, and the host may issue a step while the GPU
    still runs the one before; an eager forward whose Python is as slow as its kernels would
    otherwise leave the GPU idle at every step (docs/architecture.md, "Trainer").
    """

    def __init__(self, device: torch.device):
        self.device, self.received = device, False
        self._old = signal.signal(signal.SIGTERM, self._handle)
        self._flag: Optional[torch.Tensor] = None  # [1] on device: this call's vote, all-reduced
        self._host: Optional[torch.Tensor] = None  # [1] (pinned on CUDA): the last all-reduced vote, copied back
        self._copied: Optional[torch.cuda.Event] = None  # CUDA: recorded after that copy

    def _handle(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        """Collective over the default group: True on every rank at the same call once any rank has
        received SIGTERM (over several processes, from the previous call's vote)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        cuda = self.device.type == "cuda"
        if self._flag is None:
            self._flag = torch.zeros(1, device=self.device)
            self._host = torch.zeros(1, pin_memory=cuda)
        if self._copied is not None:
            self._copied.synchronize()  # waits for the previous call's step, not this one
        answer = bool(self._host.item())  # a host tensor (zero before the first vote): no device sync
        self._flag.fill_(1.0 if self.received else 0.0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        self._host.copy_(self._flag, non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return answer

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._old)
