"""The model config of a resumed run: the checkpoint's, with what the run sets explicitly checked against it.

A checkpoint records the model it holds: `model_config.json` in its step directory (the resolved
config: class and every field, written by tpflash.checkpoint.save for models with a `.config`), and
`config.yaml` beside the step directories (the whole TrainConfig the trainer last saved with, whose
`model` section holds the keys as given). When a run resumes:

* fields the run does not set take the checkpoint's values, so `--model.*` keys may be left out;
* fields the run sets (command line or YAML; a `model.preset` or `model.init_from` sets every field
  it describes) must equal the checkpoint's, except the RUN_ONLY_FIELDS, which change how the same
  model is computed or initialised but not what it computes: a different value is one ValueError
  naming each field, both values and the override, `checkpoint.allow_config_change=FIELD,...`,
  which accepts deliberate changes (e.g. more heads at the same width: every shape stays, so the
  weights load, but they mean something else).

Everything here reads files only (the same files on every rank), so every rank reaches the same
answer before any process group exists.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

import yaml

from ..checkpoint.extras import CONFIG_FILE
from .build import resolve_model_config

# GPTConfig fields a resumed run may change freely: the same weights compute the same function.
# sequence_parallel (tp layout of activations), activation_checkpointing (recompute in backward)
# fused_loss (a chunked kernel for the same loss) and fp8 (the GEMMs' precision; no fp8 state is
# saved) change how it is computed; init_std only draws
# the initial weights, which the checkpoint replaces; seed only seeds the dropout streams (which
# the checkpoint restores where the world size is unchanged). Every other field, dropout included
# (it changes the training loss), is compared.
RUN_ONLY_FIELDS = ("sequence_parallel", "activation_checkpointing", "fused_loss", "fp8", "init_std", "seed")
CHOOSERS = ("preset", "init_from")  # model keys that pick a whole config rather than one field
ALLOW_KEY = "checkpoint.allow_config_change"


def _qualified(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def checkpoint_to_resume(cfg) -> Optional[str]:
    """The step directory whose recorded config a run of `cfg` resumes with, or None when it starts
    afresh: checkpoint.dir's latest, or the newest step before it whose model_config.json reads, as
    the trainer falls back past a damaged newest step (the steps of one run record one model)."""
    ck = cfg.checkpoint
    if not (ck.dir and ck.resume):
        return None
    from ..checkpoint import directory
    newest = directory.latest(ck.dir)
    if newest is None:
        return None
    for path in [newest] + [p for _, p in reversed(directory.committed_steps(ck.dir)) if p != newest]:
        if _stored_config(path) is not None:
            return path
    return newest


def model_config_for_run(cfg, vocab_size: Optional[int], config_cls) -> Any:
    """The model config of a run of `cfg`: resolve_model_config's when it does not resume, else the
    checkpoint's as described in this module's docstring. vocab_size: the tokenizer's, or None."""
    path = checkpoint_to_resume(cfg)
    allowed = check_allowed(cfg.checkpoint.allow_config_change, config_cls)
    if path is None:
        return resolve_model_config(cfg.model, vocab_size, config_cls)
    return resolve_against(path, cfg.checkpoint.dir, cfg.model, allowed, vocab_size, config_cls)


def check_allowed(names: List[str], config_cls) -> List[str]:
    """The fields checkpoint.allow_config_change names; ValueError for a name that is no field."""
    known = [f.name for f in dataclasses.fields(config_cls)] + ["preset"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{ALLOW_KEY}={','.join(names)}: {unknown} are not model config fields; "
                         f"fields: {', '.join(known)}")
    return list(names)


def resolve_against(path: str, root: str, model_keys: Dict[str, Any], allowed: List[str],
                    vocab_size: Optional[int], config_cls) -> Any:
    """The config to resume checkpoint `path` (under `root`) with: see the module docstring."""
    stored = _stored_config(path)
    if stored is not None:
        return _against_fields(path, stored, model_keys, allowed, vocab_size, config_cls)
    saved_keys = _stored_keys(root)
    if saved_keys is not None:  # a model without `.config`: the keys the checkpoint's run was given
        return _against_keys(path, saved_keys, model_keys, allowed, vocab_size, config_cls)
    if not model_keys:
        raise ValueError(f"cannot resume from {path}: it records no model config (no {CONFIG_FILE} in it, no "
                         f"config.yaml beside it), and this run sets no model keys; pass --model.preset=NAME or "
                         f"the --model.* keys it was trained with")
    return resolve_model_config(model_keys, vocab_size, config_cls)


def _stored_config(path: str) -> Optional[dict]:
    """{"class", "fields", ...} from path/model_config.json, or None when there is none."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError):  # a damaged step: the trainer falls back past it, and so does the search above
        return None


def _stored_keys(root: str) -> Optional[Dict[str, Any]]:
    """The `model` section of root/config.yaml (the keys as the saving run was given), or None."""
    file = os.path.join(root, "config.yaml")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        tree = yaml.safe_load(f) or {}
    return dict(tree.get("model") or {})


def _mismatch_error(path: str, diffs: List[str], fields: List[str]) -> ValueError:
    return ValueError(
        f"resuming from {path}: this run's model config differs from the checkpoint's in {'; '.join(diffs)}. "
        f"The weights would load but compute another model. Leave these --model keys out to take the "
        f"checkpoint's values, or accept the change with --{ALLOW_KEY}={','.join(fields)}")


def _against_fields(path: str, stored: dict, model_keys: Dict[str, Any], allowed: List[str],
                    vocab_size: Optional[int], config_cls) -> Any:
    """The checkpoint's resolved config with the run's explicit fields checked and applied."""
    if stored.get("class") != _qualified(config_cls):
        raise ValueError(f"cannot resume from {path}: its model is configured by {stored.get('class')}, "
                         f"this run builds {_qualified(config_cls)}")
    try:
        saved = config_cls(**stored["fields"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot resume from {path}: its {CONFIG_FILE} is not a valid "
                         f"{config_cls.__name__}: {e}") from None
    if not model_keys:
        return _check_vocab(path, saved, vocab_size)
    names = [f.name for f in dataclasses.fields(config_cls)]
    chooser = next((f"model.{k}={model_keys[k]!r}" for k in CHOOSERS if model_keys.get(k)), None)
    if chooser:  # a preset or HF config describes every field; the vocabulary is the tokenizer's unless given
        run = resolve_model_config(model_keys, vocab_size, config_cls)
        explicit = {n: getattr(run, n) for n in names if n in model_keys or
                    (n not in RUN_ONLY_FIELDS and (n != "vocab_size" or model_keys.get("init_from")))}
    else:  # single fields: set on the checkpoint's config (not on the defaults, which may not fit them)
        unknown = sorted(set(model_keys) - set(names) - set(CHOOSERS))
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; valid: {sorted(names)}")
        explicit = {n: model_keys[n] for n in names if n in model_keys}
    try:
        resolved = dataclasses.replace(saved, **explicit)  # its __post_init__ spells the values as saved ones are
    except ValueError:
        resolved = None  # the fields below name what the run changed
    diffs, fields = [], []
    for name, ours in explicit.items():
        ours, theirs = getattr(resolved, name) if resolved is not None else ours, getattr(saved, name)
        if name in RUN_ONLY_FIELDS or name in allowed or ours == theirs:
            continue
        source = f"--model.{name}" if name in model_keys else chooser
        diffs.append(f"{name}: checkpoint {theirs!r}, this run {ours!r} (from {source})")
        fields.append(name)
    if diffs:
        raise _mismatch_error(path, diffs, fields)
    if resolved is None:
        resolved = dataclasses.replace(saved, **explicit)  # the config error itself: nothing differs but it is invalid
    return _check_vocab(path, resolved, vocab_size)


def _against_keys(path: str, saved_keys: Dict[str, Any], model_keys: Dict[str, Any], allowed: List[str],
                  vocab_size: Optional[int], config_cls) -> Any:
    """resolve_model_config over the saved run's model keys with this run's on top, the common keys checked."""
    diffs, fields = [], []
    for name in sorted(set(saved_keys) & set(model_keys)):
        if name in RUN_ONLY_FIELDS or name in allowed or name == "init_from":  # paths differ between machines
            continue
        if saved_keys[name] != model_keys[name]:
            diffs.append(f"{name}: checkpoint {saved_keys[name]!r}, this run {model_keys[name]!r} "
                         f"(from --model.{name})")
            fields.append(name)
    if diffs:
        raise _mismatch_error(path, diffs, fields)
    return resolve_model_config({**saved_keys, **model_keys}, vocab_size, config_cls)


def _check_vocab(path: str, config, vocab_size: Optional[int]):
    """`config` if its vocabulary holds the tokenizer's ids, else ValueError (before any embedding lookup fails)."""
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise ValueError(f"resuming from {path}: the tokenizer has {vocab_size} ids but the checkpoint's model has "
                         f"vocab_size={config.vocab_size}: use the tokenizer it was trained with")
    return config
