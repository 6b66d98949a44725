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
from typing import Any, Dict, List, Optional

import torch

from .config import LogSection, TrainConfig
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
    (evaluation, checkpoints) is left out, so the rate is the training's own. `tokens_per_s` is the
    whole job's rate, `tokens_per_s_per_gpu` that over `world` (the figure the README's tables quote).
    `totals()` gives the same over the whole run so far.

    flops_per_token: training FLOPs per token of the whole model (forward + backward);
    peak: one device's peak FLOP/s; world: devices the tokens were spread over.
    """

    def __init__(self, flops_per_token: float, peak: float, world: int):
        self.flops_per_token, self.peak, self.world = flops_per_token, peak, world
        self._t0, self._tokens, self._paused_s = time.perf_counter(), 0, 0.0
        self._done_tokens, self._done_s = 0, 0.0  # the intervals already read
        self.started = self._t0  # the run's wall clock starts here (for the summary)

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

    def _rates(self, tokens: int, seconds: float) -> Dict[str, float]:
        rate = tokens / max(seconds, 1e-9)
        out = {"tokens_per_s": rate, "tokens_per_s_per_gpu": rate / self.world}
        if self.peak > 0 and self.flops_per_token > 0:
            out["mfu"] = rate * self.flops_per_token / (self.peak * self.world)
        return out

    def read(self) -> Dict[str, float]:
        """The rates since the last read; starts a new interval."""
        now = time.perf_counter()
        seconds = now - self._t0 - self._paused_s
        out = self._rates(self._tokens, seconds)
        self._done_tokens, self._done_s = self._done_tokens + self._tokens, self._done_s + seconds
        self._t0, self._tokens, self._paused_s = now, 0, 0.0
        return out

    def totals(self) -> Dict[str, float]:
        """The whole run so far (the unread interval included): tokens, training seconds and their rates."""
        seconds = self._done_s + time.perf_counter() - self._t0 - self._paused_s
        tokens = self._done_tokens + self._tokens
        return {"tokens": tokens, "train_s": seconds, **self._rates(tokens, seconds)}


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

    def warn(self, text: str) -> None:
        """A warning on stderr (rank 0): what the run does that its user probably did not mean."""
        if not self.enabled:
            return
        line = f"WARNING: {text}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def summary(self, step: int, record: Dict[str, Any], text: str) -> None:
        """The end-of-run record: one JSON line of kind "summary" in metrics.jsonl, `text` on stdout."""
        if not self.enabled:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps({"kind": "summary", "step": step, "time": round(time.time(), 3),
                                         **record}) + "\n")
        self.note(text)

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


NO_CHECKPOINT_DIR = ("no checkpoint.dir: nothing of this run is saved; set --checkpoint.dir=DIR "
                     "(e.g. runs/NAME/ckpt) to save and resume it")


def start_warnings(cfg: TrainConfig) -> List[str]:
    """What a run's config does that is probably not meant, said before its first step (rank 0)."""
    out = []
    if not cfg.checkpoint.dir:
        out.append(NO_CHECKPOINT_DIR)
    t = cfg.train
    if 0 < t.steps < t.warmup_steps:
        reached = t.lr * t.steps / t.warmup_steps  # linear warmup: lr * (step + 1) / warmup at the last step
        out.append(f"train.warmup_steps={t.warmup_steps} > train.steps={t.steps}: the run never reaches "
                   f"train.lr={t.lr:g} (its last step uses {reached:.3g}); lower train.warmup_steps")
    return out


def end_warnings(cfg: TrainConfig) -> List[str]:
    """Repeated after the last step, where a long run's user looks."""
    return [NO_CHECKPOINT_DIR] if not cfg.checkpoint.dir else []


def run_summary(cfg: TrainConfig, meter: Throughput, first_step: int, step: int, saved_step: int,
                last: Dict[str, float], device: torch.device):
    """(record, text) of the end-of-run summary: steps, tokens, time, mean tokens/s per GPU, MFU
    (where the device's peak is known), peak memory, final train and eval loss, and where the
    checkpoints and metrics are."""
    totals = meter.totals()
    wall_s = time.perf_counter() - meter.started
    memory = memory_gb(device)  # this rank's (rank 0 writes the summary)
    record = {"steps": step - first_step, "first_step": first_step + 1, "last_step": step,
              "tokens": totals["tokens"], "time_s": wall_s, "train_s": totals["train_s"],
              "tokens_per_s": totals["tokens_per_s"], "tokens_per_s_per_gpu": totals["tokens_per_s_per_gpu"],
              **({"mfu": totals["mfu"]} if "mfu" in totals else {}), **memory,
              **{k: last[k] for k in ("loss", "eval_loss") if k in last}}
    ck, log_dir = cfg.checkpoint.dir, cfg.log.dir
    where_ck = (f"checkpoints: {ck} (newest step {saved_step})" if ck and saved_step >= 0
                else f"checkpoints: none written to {ck}" if ck else "checkpoints: none (no checkpoint.dir)")
    where_log = f"metrics: {os.path.join(log_dir, 'metrics.jsonl')}" if log_dir else "metrics: stdout only (no log.dir)"
    mem = ", ".join(f"{k} {_format(v)}" for k, v in memory.items())
    losses = " ".join(f"{k} {_format(record[k])}" for k in ("loss", "eval_loss") if k in record) or "no loss logged"
    text = (f"run summary: steps {record['first_step']}-{step} ({record['steps']} steps), {totals['tokens']} tokens "
            f"in {_format(wall_s)} s ({_format(totals['train_s'])} s training), "
            f"{_format(totals['tokens_per_s_per_gpu'])} tokens/s per GPU x {meter.world}, "
            f"mfu {_format(totals['mfu']) if 'mfu' in totals else 'n/a'}, peak {mem} (rank 0), {losses}; "
            f"{where_ck}; {where_log}")
    return record, text


def finish(out: MetricsWriter, cfg: TrainConfig, meter: Throughput, first_step: int, step: int, saved_step: int,
           last: Dict[str, float], device: torch.device) -> None:
    """The end of a run (finished or stopped by SIGTERM) on rank 0: the summary, then the warnings again."""
    out.summary(step, *run_summary(cfg, meter, first_step, step, saved_step, last, device))
    for text in end_warnings(cfg):
        out.warn(text)
