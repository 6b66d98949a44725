"""What a checkpoint holds besides tensors: step, user extras, RNG states and the model's config.

`meta` (written by rank 0 only) holds the step, the extras and the layout the checkpoint was
saved at. Extras with `state_dict()` / `load_state_dict()` (an LR scheduler, a data sampler)
are saved as their state dict and restored in place when `load` is given an object of the same
name; other extras are plain values that `load` returns. Extras must be the same on every
rank (rank 0's are written). RNG states are per rank ("rng.rank_<r>") and restored only when
the world size is unchanged: with a different layout there is no meaningful mapping.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

META_KEY = "meta"
RNG_PREFIX = "rng.rank_"
CONFIG_FILE = "model_config.json"
FORMAT = 1


def is_stateful(value: object) -> bool:
    """Whether `value` has state_dict/load_state_dict (saved through them, restored in place)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def model_config(model: nn.Module) -> Optional[dict]:
    """`model.config` as a JSON-able dict ({"class": ..., "fields": ...}), or None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        fields = dataclasses.asdict(config)
    elif callable(getattr(config, "to_dict", None)):
        fields = config.to_dict()
    else:
        return None
    cls = type(config)
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "fields": fields, "model_class": _model_class(model)}


def _model_class(model: nn.Module) -> str:
    """The model's own class (FSDP2 swaps in a generated subclass from torch.distributed: skip it)."""
    cls = next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed")), type(model))
    return f"{cls.__module__}.{cls.__qualname__}"


def meta_for_save(step: int, extras: Dict[str, object], model: nn.Module, layout: Dict[str, int]) -> dict:
    """The checkpoint's non-tensor record: step, extras (stateful ones as their state_dict), layout,
    model config and torch version."""
    stateful = sorted(name for name, value in extras.items() if is_stateful(value))
    values = {name: (value.state_dict() if name in stateful else value) for name, value in extras.items()}
    return {"format": FORMAT, "step": step, "extras": values, "stateful": stateful, "layout": layout,
            "model_config": model_config(model), "torch": str(torch.__version__)}


def restore_extras(meta: dict, extras: Dict[str, object]) -> dict:
    """load_state_dict into each given extra; return {"step", every extra not restored in place}.

    ValueError when an extra given to `load` is not in the checkpoint (same on every rank).
    """
    saved = meta["extras"]
    unknown = sorted(set(extras) - set(saved))
    if unknown:
        raise ValueError(f"extras {unknown} were passed to load but the checkpoint has only {sorted(saved)}")
    result = {"step": meta["step"]}
    for name, value in saved.items():
        target = extras.get(name)
        if target is not None and is_stateful(target):
            target.load_state_dict(value)
        else:
            result[name] = value
    return result


def rng_state(model=None) -> dict:
    """This process's RNG states: torch CPU, CUDA (current device), Python, NumPy (if imported),
    and the model's dropout streams (`model.rng_tracker`, tpflash.parallel.random) if it has them."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    tracker = getattr(model, "rng_tracker", None)
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    import sys
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: dict, model=None) -> None:
    """Restore what `rng_state(model)` returned (the tracker's streams only into a model that has one)."""
    torch.set_rng_state(state["torch"])
    tracker = getattr(model, "rng_tracker", None)
    if tracker is not None and "tracker" in state:
        tracker.set_states(state["tracker"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy
        numpy.random.set_state(state["numpy"])


def split_meta_keys(keys) -> Tuple[bool, Dict[int, str]]:
    """(has meta, {rank: rng key}) among a checkpoint's keys."""
    rng = {int(k[len(RNG_PREFIX):]): k for k in keys if k.startswith(RNG_PREFIX)}
    return META_KEY in keys, rng
