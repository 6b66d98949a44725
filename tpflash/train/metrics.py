"""Training metrics: throughput, MFU, memory, and where they are written (stdout, JSONL, TensorBoard).

Only the process with global rank 0 writes; every value it writes has already been reduced
over the ranks that contribute to it (the trainer does that).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import sys
import time
from typing import Any, Dict, Optional

import torch

from .config import LogSection
from .trace import check_trace

H100_BF16_DENSE_FLOPS = 989e12  # per GPU: the default MFU denominator on CUDA


def peak_flops(cfg: LogSection, device: torch.device) -> float:
    """Peak FLOP/s of one device for MFU: the configured value, else the H100 bf16 dense peak on CUDA,
    else 0 (no MFU on CPU)."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops
    return H100_BF16_DENSE_FLOPS if device.type == "cuda" else 0.0


def memory_gb(device: torch.device) -> Dict[str, float]:
    """Peak memory so far: CUDA allocator peak on GPU; this process's max RSS on CPU."""
    if device.type == "cuda":
        return {"mem_gb": torch.cuda.max_memory_allocated(device) / 2**30,
                "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"rss_gb": rss_kb / 2**20}


class Throughput:
    """Tokens/s and MFU over the training time since the last `read()`: time spent inside `paused()`
    (evaluation, checkpoints) is left out, so the rate is the training's own.

    flops_per_token: training FLOPs per token of the whole model (forward + backward);
    peak: one device's peak FLOP/s; world: devices the tokens were spread over.
    """

    def __init__(self, flops_per_token: float, peak: float, world: int):
        self.flops_per_token, self.peak, self.world = flops_per_token, peak, world
        self._t0, self._tokens, self._paused_s = time.perf_counter(), 0, 0.0

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    @contextlib.contextmanager
    def paused(self, device: Optional[torch.device] = None):
        """Leave the time of the enclosed work out of the rate. On CUDA the training steps the host
        queued are waited for first, so that their time still counts as training."""
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def read(self) -> Dict[str, float]:
        now = time.perf_counter()
        rate = self._tokens / max(now - self._t0 - self._paused_s, 1e-9)
        self._t0, self._tokens, self._paused_s = now, 0, 0.0
        out = {"tokens_per_s": rate}
        if self.peak > 0 and self.flops_per_token > 0:
            out["mfu"] = rate * self.flops_per_token / (self.peak * self.world)
        return out


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


class MetricsWriter:
    """Writes metric records on rank 0: a progress bar (tqdm) or plain lines on stdout,
    `log.dir/metrics.jsonl`, and TensorBoard under `log.dir/tb` when it is installed."""

    def __init__(self, cfg: LogSection, total_steps: int, start_step: int, enabled: bool):
        self.enabled, self.jsonl, self.tb, self.bar = enabled, None, None, None
        if not enabled:
            return
        if cfg.dir:
            os.makedirs(cfg.dir, exist_ok=True)
            self.jsonl = open(os.path.join(cfg.dir, "metrics.jsonl"), "a", buffering=1)
            self.tb = _tensorboard(cfg, os.path.join(cfg.dir, "tb"))
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        if mode == "bar" and not _has_tqdm():
            mode = "lines"  # tqdm is optional
        if mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, desc="train")
        self.lines = mode in ("lines", "bar")

    def log(self, step: int, record: Dict[str, Any], kind: str = "train") -> None:
        """Write one record (values are numbers) for optimizer step `step`."""
        if not self.enabled:
            return
        full = {"kind": kind, "step": step, "time": round(time.time(), 3), **record}
        if self.jsonl:
            self.jsonl.write(json.dumps(full) + "\n")
        if self.tb:
            for key, value in record.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{kind}/{key}", value, step)
        text = f"[{kind}] step {step} " + " ".join(f"{k}={_format(v)}" for k, v in record.items())
        if self.bar is not None:
            self.bar.write(text)
        elif self.lines:
            print(text, flush=True)

    def note(self, text: str) -> None:
        """A free-form line on stdout (rank 0)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, step: int, postfix: Optional[Dict[str, Any]] = None) -> None:
        if self.bar is not None:
            self.bar.n = step
            if postfix:
                self.bar.set_postfix({k: _format(v) for k, v in postfix.items()}, refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        for thing in (self.bar, self.tb, self.jsonl):
            if thing is not None:
                thing.close()


def _has_tqdm() -> bool:
    try:
        importlib.import_module("tqdm")
        return True
    except ImportError:
        return False


def check_logging(cfg: LogSection) -> None:
    """Raise ValueError now (before any collective) if log.tensorboard=on or log.trace cannot be honoured."""
    check_trace(cfg.trace, cfg.dir)
    if cfg.tensorboard == "on":
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError:
            raise ValueError("log.tensorboard=on but tensorboard is not installed (pip install tensorboard)") from None


def _tensorboard(cfg: LogSection, path: str):
    if cfg.tensorboard == "off":
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if cfg.tensorboard == "on":
            raise ValueError("log.tensorboard=on but tensorboard is not installed (pip install tensorboard)") from None
        return None
    return SummaryWriter(path)
