"""Host staging: copy the state to host memory, then write it from there (an async save: in a background
thread; a synchronous one: at once, through several writer threads).

An async save's background thread's collectives (DCP's planning, the checksum gather, the commit
broadcast) run on a dedicated gloo group, so they never interleave with the training
collectives that the main thread issues meanwhile on the default group.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .directory import directory_bytes
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


def _page_locked_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor, registered with CUDA as page-locked for its lifetime. Registered rather
    than taken from torch's pinned allocator, which rounds every block up to a power of two (up to
    twice the state's size in host memory)."""
    buffer = torch.empty(shape, dtype=dtype)
    size = buffer.numel() * buffer.element_size()
    if size and int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)) == 0:
        weakref.finalize(buffer, torch.cuda.cudart().cudaHostUnregister, buffer.data_ptr())
    return buffer  # unregistered where that failed: its copies are pageable, and correct


def _tensors(state: dict):
    """(key, tensor) of every tensor in a save's state dict, a chunk's piece for a Chunk."""
    for key, value in state.items():
        tensor = value.piece if isinstance(value, Chunk) else value
        if torch.is_tensor(tensor):
            yield key, tensor.detach()


def state_bytes(state: dict) -> int:
    """The bytes of the tensors in a save's state dict (chunks' pieces counted)."""
    return sum(t.numel() * t.element_size() for _, t in _tensors(state))


def host_memory_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read: not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fits_in_host_memory(state: dict, local_ranks: int, available: Optional[int]) -> bool:
    """Whether `local_ranks` ranks of this node can each hold a host copy of a state like `state` in at most
    half of the `available` host memory (bytes; None: unknown, so no)."""
    return available is not None and state_bytes(state) * max(1, local_ranks) <= available // 2


class HostStaging:
    """The host buffers a save copies the state into (an async save before it returns), kept from one
    save to the next. `pinned` (the trainer's choice on CUDA): page-locked buffers, which take the device's
    tensors at the link's speed with one wait for all of them, instead of a pageable copy per tensor;
    allocated on the first save, or ahead of it by `reserve` (page-locking tens of GB takes tens of
    seconds), they hold one rank's state in host memory for as long as this object lives. Pass the
    same one to every save of a run (`checkpoint.save(..., staging=)`); a save waits until the
    previous write from these buffers has finished."""

    def __init__(self, pinned: bool = True):
        self.pinned = pinned and torch.cuda.is_available()
        self._buffers: Dict[str, torch.Tensor] = {}  # state key -> its host buffer
        self._reader: Optional["PendingSave"] = None  # the background write still reading them
        self._reserving: Optional[threading.Thread] = None  # allocating buffers ahead of the first stage()

    def reserve(self, state: dict) -> None:
        """Start allocating, in a background thread, the buffers that staging a state shaped like `state`
        needs (its tensors are not read), so that the first stage() only copies."""
        self._wait_for_buffers()
        wanted = [(key, t.shape, t.dtype, t.is_cuda) for key, t in _tensors(state) if key not in self._buffers]
        self._reserving = threading.Thread(target=self._allocate, args=(wanted,), daemon=True,
                                           name="tpflash-staging-reserve")
        self._reserving.start()

    def _allocate(self, wanted) -> None:
        for key, shape, dtype, is_cuda in wanted:
            self._buffers[key] = self._empty(shape, dtype, is_cuda)

    def _empty(self, shape: torch.Size, dtype: torch.dtype, for_cuda: bool) -> torch.Tensor:
        return _page_locked_empty(shape, dtype) if self.pinned and for_cuda else torch.empty(shape, dtype=dtype)

    def _wait_for_buffers(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def stage(self, state: dict) -> dict:
        """A copy of `state` whose tensors (and chunks' pieces) are these host buffers."""
        self._wait_for_buffers()
        if self._reader is not None:
            self._reader.wait()
            self._reader = None
        devices = set()
        out = {}
        for key, value in state.items():
            if isinstance(value, Chunk):
                out[key] = Chunk(self._copy(key, value.piece, devices), value.offsets, value.shape)
            elif torch.is_tensor(value):
                out[key] = self._copy(key, value, devices)
            else:
                out[key] = value
        for device in devices:  # the copies were queued without waiting: wait once for each device's
            torch.cuda.current_stream(device).synchronize()
        return out

    def read_by(self, pending: "PendingSave") -> None:
        """The background write `pending` reads the buffers: the next stage() waits for it."""
        self._reader = pending

    def _copy(self, key: str, source: torch.Tensor, devices: set) -> torch.Tensor:
        source = source.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            buffer = self._buffers[key] = self._empty(source.shape, source.dtype, source.is_cuda)
        queued = source.is_cuda and buffer.is_pinned()
        buffer.copy_(source, non_blocking=queued)
        if queued:
            devices.add(source.device)
        return buffer


class PendingSave(str):
    """The path of a checkpoint still being written; `wait()` blocks until it is committed (re-raising errors)."""

    def __new__(cls, path: str):
        obj = super().__new__(cls, path)
        obj._thread, obj._error = None, None
        obj.seconds = None  # how long the background write and commit took, once done
        obj.bytes = None  # the committed checkpoint's size, taken as it commits (a later save may prune it)
        return obj

    def start(self, work: Callable[[], object]) -> None:
        def run():
            started = time.perf_counter()
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                self._error = e
            self.seconds = time.perf_counter() - started
            if self._error is None:
                self.bytes = directory_bytes(str(self))

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
