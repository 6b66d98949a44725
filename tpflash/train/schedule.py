"""Learning-rate schedule: linear warmup to the peak, then cosine decay to a floor."""
from __future__ import annotations

import math
from typing import Any, Dict

import torch


def lr_at(step: int, peak: float, floor: float, warmup: int, decay: int) -> float:
    """The learning rate for optimizer step `step` (0-based): peak*(step+1)/warmup during warmup,
    then a cosine from peak to floor over `decay` steps, then floor."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if decay <= 0:
        return peak
    progress = min(1.0, (step - warmup) / decay)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """Sets every param group's lr from the step count; its state (the step) is checkpointed."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak: float, floor: float, warmup: int, decay: int):
        if warmup < 0 or decay < 0:
            raise ValueError(f"warmup={warmup} and decay={decay} must be >= 0")
        if floor > peak:
            raise ValueError(f"min_lr={floor} is above lr={peak}")
        self.optimizer, self.peak, self.floor, self.warmup, self.decay = optimizer, peak, floor, warmup, decay
        self.step_count = 0
        self._apply()

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.peak, self.floor, self.warmup, self.decay)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def step(self) -> None:
        """Advance one optimizer step and set the next step's lr."""
        self.step_count += 1
        self._apply()

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step_count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self._apply()
