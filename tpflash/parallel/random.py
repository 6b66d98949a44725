"""Tensor-parallel-consistent random numbers for dropout (Megatron's tracked RNG states, made explicit).

Dropout must draw the *same* mask on every tp rank where the activation is replicated over tp
(otherwise the replicas diverge) and *different* masks where the activation is sharded (the
shards are different tokens or heads, so equal masks would correlate them). An `RNGTracker`
holds two named generator states:

    "replicated"  seeded from (seed, dp_rank): identical across the tp group
    "sharded"     seeded from (seed, dp_rank, tp_rank): different on every tp rank

`with tracker.fork("sharded"):` swaps the device's default generator to that state for the
duration, so ordinary ops (F.dropout) draw from it, and saves the advanced state back on exit.
A tracker is a plain object owned by whoever builds it (a model makes one, a test may replace
it); nothing here is module-level. `checkpoint_context_fns` lets activation checkpointing replay
the same masks in the recompute.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Tuple

import torch
import torch.nn.functional as F

STREAMS = ("replicated", "sharded")
_TP_OFFSET = 2718  # keeps the sharded stream's seeds away from the replicated one's
_DP_STRIDE = 1_000_003


def _get_device_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _resolve(device) -> torch.device:
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The default generator's state after manual_seed(seed), leaving the real default untouched."""
    saved = _get_device_state(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)  # seeds the current device only
    else:
        torch.default_generator.manual_seed(seed)  # torch.manual_seed would reseed CUDA too
    state = _get_device_state(device)
    _set_device_state(device, saved)
    return state


class RNGTracker:
    """Named RNG streams for one (dp_rank, tp_rank); see the module docstring.

    States are kept per device and created on first use there (seeded from seed, dp_rank and, for
    "sharded", tp_rank), so a model built on CPU and moved to CUDA keeps consistent streams.
    """

    def __init__(self, seed: int = 0, tp_rank: int = 0, dp_rank: int = 0):
        self.seed, self.tp_rank, self.dp_rank = seed, tp_rank, dp_rank
        self._states: Dict[str, torch.Tensor] = {}  # "stream@device" -> generator state

    def _seed(self, stream: str) -> int:
        base = self.seed + _DP_STRIDE * self.dp_rank
        return base + _TP_OFFSET + self.tp_rank if stream == "sharded" else base

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of every stream's state, keyed "stream@device" (for checkpoints and recompute)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        for key in states:
            if key.split("@")[0] not in STREAMS:
                raise ValueError(f"unknown RNG stream in key {key!r}; streams are {STREAMS}")
        self._states.update({k: v.clone() for k, v in states.items()})

    @contextlib.contextmanager
    def fork(self, stream: str, device=None) -> Iterator[None]:
        """Run the body with `device`'s default generator (CPU when None) set to `stream`'s state."""
        if stream not in STREAMS:
            raise ValueError(f"unknown RNG stream {stream!r}; streams are {STREAMS}")
        device = _resolve(device)
        key = f"{stream}@{device}"
        if key not in self._states:
            self._states[key] = _seeded_state(device, self._seed(stream))
        outside = _get_device_state(device)
        _set_device_state(device, self._states[key])
        try:
            yield
        finally:
            self._states[key] = _get_device_state(device)
            _set_device_state(device, outside)

    def dropout(self, x: torch.Tensor, p: float, sharded: bool, training: bool = True) -> torch.Tensor:
        """F.dropout(x, p) with the mask drawn from the stream that fits x's layout over tp:
        `sharded=True` when x holds different values on each tp rank (SP activations, head shards)."""
        if p == 0.0 or not training:
            return x
        with self.fork("sharded" if sharded else "replicated", x.device):
            return F.dropout(x, p, training=True)

    def checkpoint_context_fns(self) -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """`context_fn` for torch.utils.checkpoint(use_reentrant=False): the recompute replays the
        streams as they were at the original forward, then the tracker continues where it was."""
        at_forward = self.get_states()

        @contextlib.contextmanager
        def recompute():
            now, self._states = self._states, dict(at_forward)  # streams first used inside re-seed alike
            try:
                yield
            finally:
                self._states = now

        return contextlib.nullcontext(), recompute()
