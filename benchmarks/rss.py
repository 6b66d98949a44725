"""Peak resident memory of this process while a block of code runs, sampled from /proc/self/status.

    with PeakRss() as rss:
        load_something()
    rss.anon_growth  # bytes: peak RssAnon (private heap: what a loader really allocates) minus the start
    rss.file_growth  # bytes: peak RssFile minus the start (file pages mapped in, e.g. a mmapped checkpoint)

A background thread samples every `interval_s`; torch releases the GIL inside its kernels, so
the sampler keeps running while tensors are copied. Linux only.
"""
from __future__ import annotations

import ctypes
import gc
import re
import threading
import time


def _status() -> dict:
    with open("/proc/self/status") as f:
        text = f.read()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", text).group(1)) * 1024 for key in ("RssAnon", "RssFile")}


def release_free_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so that a baseline is not inflated."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakRss:
    """Context manager: peak RssAnon/RssFile growth (bytes) over the block, sampled every interval_s."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.anon_growth = self.file_growth = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        now = _status()
        self._peak_anon = max(self._peak_anon, now["RssAnon"])
        self._peak_file = max(self._peak_file, now["RssFile"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakRss":
        release_free_memory()
        start = _status()
        self._start_anon, self._start_file = start["RssAnon"], start["RssFile"]
        self._peak_anon, self._peak_file = self._start_anon, self._start_file
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.anon_growth = self._peak_anon - self._start_anon
        self.file_growth = self._peak_file - self._start_file
