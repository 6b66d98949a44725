"""Optimizer state keyed by parameter *name*, each state tensor following its parameter's layout.

`torch.optim` keys state by parameter index, which changes when the model is re-laid out;
names do not. In the checkpoint, "optim.state.<param name>.<state key>" holds a tensor shaped
like the parameter (AdamW's exp_avg, exp_avg_sq) is stored unsharded, in chunks exactly like
the parameter itself (see layout.py); other tensors (AdamW's scalar `step`) are plain replicated
tensors; anything else is pickled. "optim.param_groups" holds the hyper-parameters, with
parameter names in place of indices.
"""
from __future__ import annotations

from typing import Collection, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .blob import from_blob, to_blob
from .layout import MODEL_PREFIX, TensorSlot

STATE_PREFIX = "optim.state."
GROUPS_KEY = "optim.param_groups"
# how this process runs its optimizer, not training state: loading keeps the optimizer's own values,
# so that a checkpoint saved with foreach kernels on CPU does not turn off a GPU run's fused ones
RUNTIME_KEYS = ("fused", "foreach", "capturable", "differentiable")


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> List[List[str]]:
    """Each param group's parameter names (in the group's order). ValueError for a foreign parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"optimizer param group {i} holds parameters (shapes {missing[:3]}) that are not "
                             "parameters of the model (build the optimizer after apply_fsdp)")
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def _param_slots(model_slots: List[TensorSlot]) -> Dict[str, TensorSlot]:
    return {s.key[len(MODEL_PREFIX):]: s for s in model_slots}


def state_for_save(model: nn.Module, optimizer: torch.optim.Optimizer,
                   model_slots: List[TensorSlot]) -> Dict[str, object]:
    """The optimizer's entries of a checkpoint state dict (collective under FSDP: call on all ranks)."""
    groups = _param_names(model, optimizer)
    params = _param_slots(model_slots)
    sd = optimizer.state_dict()
    index_to_name = [name for group in groups for name in group]
    out: Dict[str, object] = {}
    for index, state in sorted(sd["state"].items()):
        name = index_to_name[index]
        for k, value in state.items():
            key = f"{STATE_PREFIX}{name}.{k}"
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == params[name].target.shape:
                slot = params[name]
                out[key] = TensorSlot(key, value, slot.spec, slot.tp_rank, slot.tp_size).chunk()
            elif isinstance(value, DTensor):
                out[key] = value.full_tensor()
            else:
                out[key] = value
    out[GROUPS_KEY] = to_blob([{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                               for g, names in zip(sd["param_groups"], groups)])
    return out


def _saved_state_keys(metadata: Metadata) -> Dict[str, List[str]]:
    """{param name: [state keys]} found in the checkpoint (state keys never contain dots)."""
    found: Dict[str, List[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(STATE_PREFIX):
            name, k = key[len(STATE_PREFIX):].rsplit(".", 1)
            found.setdefault(name, []).append(k)
    return found


def load_targets(model: nn.Module, optimizer: torch.optim.Optimizer, model_slots: List[TensorSlot],
                 metadata: Metadata, state_of: Optional[Collection[str]] = None) -> Tuple[Dict[str, object], list]:
    """(entries for dcp.load to fill, the pending (name, k, slot, buffer) list `apply_loaded` finishes).

    state_of: the parameters whose state is loaded (a sharded optimizer keeps its own only); None: all.

    Raises ValueError before any I/O when the checkpoint has state for parameters the model lacks.
    """
    groups = _param_names(model, optimizer)
    params = _param_slots(model_slots)
    saved = _saved_state_keys(metadata)
    unknown = sorted(set(saved) - {n for g in groups for n in g})
    if unknown:
        raise ValueError(f"checkpoint has optimizer state for parameters the model does not have: {unknown[:5]}")
    targets: Dict[str, object] = {GROUPS_KEY: None}
    pending = []
    for name, keys in saved.items():
        if state_of is not None and name not in state_of:
            continue
        slot = params[name]
        for k in keys:
            key = f"{STATE_PREFIX}{name}.{k}"
            meta = metadata.state_dict_metadata[key]
            if not isinstance(meta, TensorStorageMetadata):
                targets[key] = None  # pickled; DCP replaces it in place
                pending.append((name, k, None, None))
            elif len(meta.size) > 0 and meta.size == slot.global_shape:
                like = TensorSlot(key, slot.target, slot.spec, slot.tp_rank, slot.tp_size)
                buffer = like.local_like(meta.properties.dtype)
                targets[key] = like.chunk(buffer)
                pending.append((name, k, like, buffer))
            else:
                targets[key] = torch.zeros(meta.size, dtype=meta.properties.dtype)
                pending.append((name, k, None, None))
    return targets, pending


def apply_loaded(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: Dict[str, object],
                 pending: list) -> None:
    """Rebuild an index-keyed optimizer state dict from loaded entries and hand it to `load_state_dict`.
    The saved hyper-parameters (lr, betas, weight_decay, ...) are restored, as torch's own
    load_state_dict does; the RUNTIME_KEYS stay this optimizer's."""
    groups = _param_names(model, optimizer)
    saved_groups = from_blob(loaded[GROUPS_KEY], f"checkpoint entry {GROUPS_KEY!r}")
    if len(saved_groups) != len(groups) or any(set(s["params"]) != set(g) for s, g in zip(saved_groups, groups)):
        raise ValueError("optimizer param groups differ from the checkpoint's: "
                         f"saved {[len(s['params']) for s in saved_groups]} parameters per group, "
                         f"now {[len(g) for g in groups]} (or different names)")
    index = {name: i for i, name in enumerate(n for g in groups for n in g)}
    state: Dict[int, Dict[str, object]] = {}
    for name, k, slot, buffer in pending:
        value = loaded[f"{STATE_PREFIX}{name}.{k}"]
        if slot is not None:
            value = buffer
            if isinstance(slot.target, DTensor):  # the FSDP parameter's layout, so the optimizer can use it
                value = DTensor.from_local(buffer, slot.target.device_mesh, slot.target.placements, run_check=False,
                                           shape=slot.target.shape, stride=slot.target.stride())
        state.setdefault(index[name], {})[k] = value
    param_groups = [{**{k: v for k, v in s.items() if k != "params"},
                     **{k: now[k] for k in RUNTIME_KEYS if k in now}, "params": [index[n] for n in g]}
                    for s, g, now in zip(saved_groups, groups, optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
