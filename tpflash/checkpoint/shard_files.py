"""How a save writes its files: DCP's FileSystem with write streams that copy the bytes into reused,
page-aligned blocks, and hand each full block to a few threads that hash it (for the manifest, see
integrity.py) and write it at its offset, with direct I/O (O_DIRECT) where the filesystem takes it.

Why: written through the page cache, a rank's tens of GB are copied once more by the kernel and then
flushed by its writeback, and a fresh buffer per hashed block costs page faults under the GIL; both
kept a large save well below the disk's direct-I/O bandwidth (docs/performance.md, "Checkpoints of a
large model"). Direct writes of 16 MiB blocks from buffers that are reused go at the disk's speed, and
several in flight per rank keep its queue full. Where O_DIRECT is refused (tmpfs, some network or FUSE
filesystems, macOS) the same blocks go through the page cache. A file is complete once its stream is
closed: the last, partial block is written (padded to the direct-I/O alignment, then the file is
truncated to its size) and the file fsync'd; a failed write raises there, or at the next write.
"""
from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Dict, Iterator, List

import numpy as np
from torch.distributed.checkpoint.filesystem import FileSystem

from .integrity import BLOCK_BYTES

try:
    import fcntl
except ImportError:  # not POSIX: no direct I/O either
    fcntl = None

IO_THREADS = 4  # blocks hashed and written side by side, per process (hashlib and pwrite release the GIL)
BLOCKS_PER_FILE = 4  # aligned buffers a file's stream cycles through: 64 MiB per file being written
ALIGN = 4096  # direct I/O's alignment of buffer address, offset and length (covers 512-byte devices)
_DIRECT = getattr(os, "O_DIRECT", 0) if fcntl else 0  # 0 where the platform has none: the page cache


def _open_for_writing(path: str, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem takes no direct I/O
                raise
    return os.open(path, flags, 0o644)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    retried = False
    while data.nbytes:
        try:
            written = os.pwrite(fd, data, offset)
        except OSError as e:  # a filesystem that opened with O_DIRECT but refuses the write: the page cache
            if e.errno != errno.EINVAL or not _DIRECT or retried:
                raise
            # once, whether the descriptor still has O_DIRECT or another block's write, refused alike,
            # has just turned it off (the pool writes a file's blocks from several threads)
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & _DIRECT:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_DIRECT)
            retried = True
            continue
        data, offset = data[written:], offset + written


class _BlockStream:
    """A file written front to back (DCP's save stream: write, tell, flush, fileno, close). Bytes are
    copied into the current aligned block; a full block goes to `pool`, which hashes it and writes it
    at its offset, then gives the buffer back. Seeking is refused: every file is appended only."""

    def __init__(self, path: str, pool: ThreadPoolExecutor, block_bytes: int, direct: bool):
        self.path, self.pool, self.block_bytes = path, pool, block_bytes
        self._aligned = block_bytes % ALIGN == 0  # direct I/O needs aligned offsets; then only the last block is short
        self.fd = _open_for_writing(path, direct and self._aligned)
        self._free: "queue.Queue[mmap.mmap]" = queue.Queue()
        self._made = 0  # buffers allocated so far (at most BLOCKS_PER_FILE)
        self._block, self._filled = None, 0  # the block being filled and how many bytes it holds
        self._offset = 0  # file offset of the block being filled
        self._jobs: List[Future] = []  # one per block handed to the pool, in file order: its sha256
        self._closed = False
        self._error = None  # the first failed write, raised by the next write or the close

    def _take_buffer(self) -> mmap.mmap:
        if self._free.empty() and self._made < BLOCKS_PER_FILE:
            self._made += 1
            return mmap.mmap(-1, -(-self.block_bytes // ALIGN) * ALIGN)  # page-aligned, as O_DIRECT needs
        buffer = self._free.get()
        self._raise_failed_writes()
        return buffer

    def _raise_failed_writes(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return 0
        source = np.frombuffer(view, dtype=np.uint8)
        done = 0
        while done < view.nbytes:
            if self._block is None:
                self._block, self._filled = self._take_buffer(), 0
            take = min(self.block_bytes - self._filled, view.nbytes - done)
            target = np.frombuffer(self._block, dtype=np.uint8, count=take, offset=self._filled)
            np.copyto(target, source[done:done + take])  # numpy copies without holding the GIL
            self._filled += take
            done += take
            if self._filled == self.block_bytes:
                self._submit()
        return view.nbytes

    def _submit(self) -> None:
        block, size, offset = self._block, self._filled, self._offset
        self._block, self._filled, self._offset = None, 0, offset + size
        self._jobs.append(self.pool.submit(self._hash_and_write, block, size, offset))

    def _hash_and_write(self, block: mmap.mmap, size: int, offset: int) -> str:
        try:
            with memoryview(block) as view:
                digest = hashlib.sha256(view[:size]).hexdigest()
                # a short last block is padded for direct I/O; close() truncates the file to its size
                padded = -(-size // ALIGN) * ALIGN if self._aligned else size
                _pwrite_all(self.fd, view[:padded], offset)
            return digest
        except BaseException as e:
            self._error = self._error or e
            raise
        finally:
            self._free.put(block)

    @property
    def direct(self) -> bool:
        """Whether the file is being written with direct I/O (else through the page cache)."""
        return bool(_DIRECT and fcntl.fcntl(self.fd, fcntl.F_GETFL) & _DIRECT)

    def tell(self) -> int:
        return self._offset + self._filled

    def flush(self) -> None:
        """Nothing: a block is written once full, and the file is complete once closed."""

    def fileno(self) -> int:
        return self.fd

    def seek(self, *args) -> int:
        raise OSError(errno.ESPIPE, f"{self.path} is written front to back; seek is not supported")

    def close(self) -> None:
        """Write the last block, wait for every write, truncate to the bytes written, fsync, close."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._filled:
                self._submit()
            wait(self._jobs)  # all of them, before the file and the buffers go, even if one failed
            self._raise_failed_writes()
            os.ftruncate(self.fd, self.tell())
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self._free, self._block = queue.Queue(), None  # the buffers go with their last reference

    def digests(self) -> List[str]:
        """The sha256 of each block of the file, in order (after close)."""
        return [job.result() for job in self._jobs]


class ShardFileSystem(FileSystem):
    """DCP's local FileSystem (give it to a FileSystemWriter as `.fs`) whose write streams are
    _BlockStreams sharing IO_THREADS threads: `digests` maps each written file's name to the sha256 of
    its `block_bytes` blocks. `direct=False` keeps the page cache. `close()` (or leaving its `with`)
    stops the threads."""

    def __init__(self, block_bytes: int = BLOCK_BYTES, direct: bool = True):
        super().__init__()
        self.block_bytes, self.direct = block_bytes, direct
        self.digests: Dict[str, List[str]] = {}
        self._lock = threading.Lock()  # DCP's writer threads each write their own files
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="tpflash-write")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "ShardFileSystem":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _BlockStream(os.fspath(path), self._pool, self.block_bytes, self.direct)
        try:
            yield stream
        finally:
            stream.close()
        with self._lock:
            self.digests[os.path.basename(os.fspath(path))] = stream.digests()
