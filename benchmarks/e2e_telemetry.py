"""The GPU's SM clock and power draw while a benchmark runs, sampled by nvidia-smi in the background.

An H100 or H200 running large bf16 GEMMs back to back sits at its 700 W power cap and lowers its
SM clock to stay there (docs/performance.md, "Where tpflash does not yet win"). Two step times measured at different
clocks are not comparable kernel for kernel, and a change that removes memory-bound passes can
come back as slower GEMMs. bench_e2e.py therefore reports, beside each row's step time, the mean
SM clock and power over its timed steps and the share of samples with the power cap active.

    with GpuTelemetry(torch.cuda.current_device()) as tel:
        ... timed steps ...
    tel.summary()  # {"sm_mhz": 1672.0, "power_w": 688.0, "power_capped": 0.97} or {} where unavailable
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Dict, List

_FIELDS = "clocks.sm,power.draw,clocks_event_reasons.sw_power_cap"


class GpuTelemetry:
    """Context manager: samples GPU `index` every `interval_ms` while open; `summary()` after.
    Does nothing (an empty summary) where nvidia-smi is missing or fails."""

    def __init__(self, index: int, interval_ms: int = 20):
        self.index, self.interval_ms = index, interval_ms
        self.proc, self.log, self.samples = None, None, []  # samples: (MHz, W, capped)

    def __enter__(self) -> "GpuTelemetry":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        # the physical index: nvidia-smi ignores CUDA_VISIBLE_DEVICES
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [v for v in visible.split(",") if v.strip()]
        physical = ids[self.index] if self.index < len(ids) else str(self.index)
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(
                [smi, f"--query-gpu={_FIELDS}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}",
                 f"--id={physical}"], stdout=self.log, stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.seek(0)
        self.samples = parse_samples(self.log.read().splitlines())
        self.log.close()
        os.unlink(self.log.name)

    def summary(self) -> Dict[str, float]:
        """Means over the samples taken while open; {} if there were none."""
        if not self.samples:
            return {}
        return {"sm_mhz": round(statistics.mean(s[0] for s in self.samples), 1),
                "power_w": round(statistics.mean(s[1] for s in self.samples), 1),
                "power_capped": round(sum(s[2] for s in self.samples) / len(self.samples), 3)}


def parse_samples(lines: List[str]) -> List[tuple]:
    """[(MHz, W, capped)] from nvidia-smi csv lines "1665, 688.12, Active"; other lines skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            out.append((float(parts[0]), float(parts[1]), parts[2] == "Active"))
        except ValueError:
            continue
    return out
