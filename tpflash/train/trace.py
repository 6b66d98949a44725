"""A torch.profiler trace of chosen training steps: `--log.trace=START:END`.

Steps START..END (1-based, inclusive) run under torch.profiler; each rank then writes its own
chrome trace to `log.dir/trace/rank{R}.json` (open it in https://ui.perfetto.dev or
chrome://tracing). On CUDA the trace holds the kernels and the collectives on their streams, so it
shows what overlaps what. Profiling slows the traced steps, so trace a few steps after warm-up
(compilation and autotuning happen in the first ones), e.g. `--log.trace=20:22`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional, Tuple

import torch


def parse_trace_steps(spec: str) -> Optional[Tuple[int, int]]:
    """`"START:END"` -> (START, END); "" -> None. ValueError names the value and the rule."""
    if not spec:
        return None
    start, sep, end = spec.partition(":")
    try:
        first, last = int(start), int(end if sep else start)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ValueError(f"log.trace={spec!r} must be START:END with 1 <= START <= END (the steps to trace, "
                         "e.g. 20:22), or START alone for one step")
    return first, last


def check_trace(spec: str, log_dir: str) -> None:
    """Raise ValueError now (before any collective) if `log.trace` cannot be honoured."""
    if parse_trace_steps(spec) and not log_dir:
        raise ValueError(f"log.trace={spec!r} needs log.dir: the traces are written to log.dir/trace/")


class StepTracer:
    """Runs torch.profiler over steps [first, last] of a run and writes this rank's trace; says so
    through `note` (a function taking one line, e.g. MetricsWriter.note)."""

    def __init__(self, spec: str, log_dir: str, rank: int, device: torch.device, note=print):
        self.steps = parse_trace_steps(spec)
        self.path = os.path.join(log_dir, "trace", f"rank{rank}.json")
        self.device, self.note = device, note
        self.last_traced = 0  # the last step run under the profiler (0: none)
        self._profiler = None

    def step(self, step: int):
        """A context for running step `step` (1-based): starts the profiler at the first traced step
        and marks the step in the trace."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return contextlib.nullcontext()
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
        self.last_traced = step
        return torch.profiler.record_function(f"train_step {step}")

    def after_step(self, step: int) -> None:
        """Call after step `step` and its logging: writes the trace after the range's last step."""
        if self.steps is not None and step == self.steps[1]:
            self.close()

    def close(self) -> Optional[str]:
        """Stop the profiler if it runs (also when the run ends inside the traced steps) and write
        the trace atomically; returns its path, or None when nothing was traced (and says why)."""
        if self._profiler is None:
            if self.steps is not None and not self.last_traced:
                self.note(f"log.trace={self.steps[0]}:{self.steps[1]}: no step of that range ran; nothing was traced")
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the traced steps' kernels finish inside the trace
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp"
        profiler.export_chrome_trace(tmp)
        os.replace(tmp, self.path)
        self.note(f"trace of steps {self.steps[0]}-{self.last_traced} written to {os.path.dirname(self.path)}/ "
                  "(one file per rank; open in ui.perfetto.dev)")
        return self.path
