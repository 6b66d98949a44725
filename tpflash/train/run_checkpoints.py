"""A run's checkpoint directory (`checkpoint.*` of the trainer's config): its lock, the step to resume
from, timed saves (synchronous and async), the Hugging Face load and export, and the timing records they
leave for the metrics (tpflash.train.io_times). The trainer decides when; this does the I/O.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import checkpoint
from .config import TrainConfig, to_yaml
from .io_times import SaveTimes, rate_record

_UNKNOWN = object()  # the resume point before the (collective) search for it


class RunCheckpoints:
    """checkpoint.dir for one run. Collective like tpflash.checkpoint itself: building it (the directory
    is claimed: a directory another live job holds is refused on every rank), `resume_point`, `load`,
    `save`, `export_hf`. Timing records are kept on rank 0 (`take_records`)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self.ck = cfg, cfg.checkpoint
        self.is_main = dist.get_rank() == 0
        self.warnings: List[str] = []  # fallbacks past damaged steps, lock takeovers (also printed by rank 0)
        self.saved_step = -1  # the newest step this run has saved or resumed (-1: none)
        self.save_times = SaveTimes()
        # pinned host buffers, reused by every save: async saves copy the state there; synchronous ones
        # too where the node has room (reserve_staging), then write it through several threads per rank
        self.staging = checkpoint.HostStaging() if self.ck.async_save else None
        self._records: List[Tuple[int, Dict[str, float]]] = []  # loads, saves, exports not logged yet
        self._resume_path = _UNKNOWN
        self.lock = checkpoint.claim(self.ck.dir, warn=self.warn) if self.ck.dir else None

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.is_main:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Give checkpoint.dir's lock back (at the run's end, error or not; also done at exit)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def resume_point(self) -> Optional[str]:
        """The step directory to resume from, or None: agreed by every rank and verified, newest first,
        past damaged steps (checkpoint.on_corrupt). Collective on the first call, cached after."""
        if not (self.ck.dir and self.ck.resume):
            return None
        if self._resume_path is _UNKNOWN:
            try:
                self._resume_path = checkpoint.resume_point(self.ck.dir, self.ck.on_corrupt, warn=self.warn)
            except BaseException:
                self.release()  # this job will not run: the directory is free for the next
                raise
        return self._resume_path

    def load(self, path: str, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_state_of=None,
             **extras) -> dict:
        """tpflash.checkpoint.load of `path`, timed; returns its info ({"step": ...})."""
        started = time.perf_counter()
        info = checkpoint.load(path, model, optimizer, optimizer_state_of=optimizer_state_of, **extras)
        if self.is_main:
            self._records.append((int(info["step"]), rate_record("load_s", time.perf_counter() - started, path)))
        self.saved_step = int(info["step"])
        return info

    def reserve_staging(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Page-lock the staging buffers now, in a background thread (tpflash.checkpoint.reserve_staging),
        rather than at the first save: with async saves always; with synchronous saves of GPU state where
        the node has room for every rank's copy (else they write from the GPU)."""
        if not self.ck.dir:
            return
        if self.staging is not None:
            if self.ck.interval > 0:
                checkpoint.reserve_staging(self.staging, model, optimizer)
            return
        if any(p.is_cuda for p in model.parameters()):
            staging = checkpoint.HostStaging()
            if checkpoint.reserve_staging(staging, model, optimizer, only_if_room=True):
                self.staging = staging

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, final: bool, fault,
             **extras) -> None:
        """Save `step` (async where checkpoint.async_save and not `final`; a final save also waits for
        any earlier background write, then gives the directory back), timed; rank 0 writes config.yaml
        beside the steps. `fault`: the trainer's tpflash.train.faults.Fault (kill_in_save)."""
        started, parts = time.perf_counter(), {}
        with fault.around_save(step, self.ck.dir):
            path = checkpoint.save(self.ck.dir, model, optimizer, step=step, keep=self.ck.keep,
                                   async_save=self.ck.async_save and not final, staging=self.staging,
                                   times=parts, direct_io=self.ck.direct_io, **extras)
            if final:
                checkpoint.wait_pending(self.ck.dir)
                self.release()  # the job's last write to the directory: free it for the next job
        if self.is_main:
            self._records += self.save_times.saved(step, path, time.perf_counter() - started, parts)
        self.saved_step = step
        if self.is_main:
            os.makedirs(self.ck.dir, exist_ok=True)  # an async save may not have made it yet
            with open(os.path.join(self.ck.dir, "config.yaml"), "w") as f:
                f.write(to_yaml(self.cfg))

    def load_hf(self, model: nn.Module, hf_dir: str, hf_files) -> None:
        """model.init_from's weights streamed into `model` (tpflash.models.pretrained), timed: a
        `hf_load_s` record at step 0 with the size of the directory's weight files."""
        from ..models import pretrained
        started = time.perf_counter()
        pretrained.load_pretrained_weights(model, hf_dir, hf_files)
        if self.is_main:
            weights = sum(os.path.getsize(os.path.join(hf_dir, name)) for name in os.listdir(hf_dir)
                          if name.endswith((".safetensors", ".bin")))
            self._records.append((0, rate_record("hf_load_s", time.perf_counter() - started, hf_dir, weights)))

    def export_hf(self, step: int, model: nn.Module, tokenizer_from: Optional[str]) -> str:
        """The model as a Hugging Face directory in checkpoint.export_hf, timed; returns the directory."""
        from ..models import save_pretrained
        started = time.perf_counter()
        path = save_pretrained(model, self.ck.export_hf, tokenizer_from=tokenizer_from)
        if self.is_main:
            self._records.append((step, rate_record("export_s", time.perf_counter() - started, self.ck.export_hf)))
        return path

    def take_records(self) -> List[Tuple[int, Dict[str, float]]]:
        """(step, record) of the loads, saves and exports since the last call, background writes that
        have committed since included (rank 0; empty elsewhere)."""
        if self.is_main:
            self._records += self.save_times.finished()
        records, self._records = self._records, []
        return records
