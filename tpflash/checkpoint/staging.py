"""Async save: copy the state to host memory, then write and commit in a background thread.

The background thread's collectives (DCP's planning, the checksum gather, the commit
broadcast) run on a dedicated gloo group, so they never interleave with the training
collectives that the main thread issues meanwhile on the default group.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .layout import Chunk

_groups: Dict[int, tuple] = {}  # id(default group) -> (default group, its gloo twin)


def async_group() -> Optional[dist.ProcessGroup]:
    """A gloo group over all ranks for background saves (made once per default group; collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.distributed_c10d._get_default_group()
    cached = _groups.get(id(world))
    if cached is None or cached[0] is not world:
        cached = _groups[id(world)] = (world, dist.new_group(backend="gloo"))
    return cached[1]


def stage_to_host(state: dict) -> dict:
    """A copy of `state` whose tensors (and chunks) live in host memory."""
    def stage(value):
        if isinstance(value, Chunk):
            return value.to_host()
        if torch.is_tensor(value):
            return value.detach().to("cpu", copy=True)
        return value

    return {key: stage(value) for key, value in state.items()}


class PendingSave(str):
    """The path of a checkpoint still being written; `wait()` blocks until it is committed (re-raising errors)."""

    def __new__(cls, path: str):
        obj = super().__new__(cls, path)
        obj._thread, obj._error = None, None
        obj.seconds = None  # how long the background write and commit took, once done
        return obj

    def start(self, work: Callable[[], object]) -> None:
        def run():
            started = time.perf_counter()
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                self._error = e
            self.seconds = time.perf_counter() - started

        self._thread = threading.Thread(target=run, name=f"tpflash-save:{self}", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return str(self)
