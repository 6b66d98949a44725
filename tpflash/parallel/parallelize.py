"""`parallelize(module, plan)`: turn a user's nn.Linear / nn.Embedding submodules into tpflash's
tensor-parallel layers, moving their existing weights into the shards.

The plan maps submodule names, or fnmatch patterns of them ("layers.*.attn.q"), to a style:

    "colwise"  nn.Linear    -> ColumnParallelLinear   (output features split; options: gather_output,
                                                        sequence_parallel, seq_dim, overlap, save_gathered_input)
               nn.Embedding -> ColumnParallelEmbedding (embedding features split; sequence_parallel, seq_dim)
    "rowwise"  nn.Linear    -> RowParallelLinear      (input features split; input_is_parallel,
                                                        sequence_parallel, seq_dim, overlap)
    "vocab"    nn.Embedding -> VocabParallelEmbedding (rows split; sequence_parallel, seq_dim, check_ids)

A value is a style name or a dict {"style": ..., option: value, ...}. Widths that tp does not
divide are padded (tpflash.layers.linear's module docstring). The whole plan is checked, and
every replacement built, before the module is changed: a bad plan raises one ValueError naming
the entry, the same on every rank, and no collective is issued by any of this.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch.nn as nn

from .state import NO_GROUP, ParallelState, resolve_tp_group

PlanValue = Union[str, Mapping[str, Any]]

_LINEAR_OPTIONS = ("sequence_parallel", "seq_dim", "overlap")
# style -> module type -> (options it takes, name of the tpflash layer's builder)
_STYLES: Dict[str, Dict[type, Tuple[Tuple[str, ...], str]]] = {
    "colwise": {nn.Linear: (("gather_output", "save_gathered_input") + _LINEAR_OPTIONS, "ColumnParallelLinear"),
                nn.Embedding: (("sequence_parallel", "seq_dim"), "ColumnParallelEmbedding")},
    "rowwise": {nn.Linear: (("input_is_parallel",) + _LINEAR_OPTIONS, "RowParallelLinear")},
    "vocab": {nn.Embedding: (("sequence_parallel", "seq_dim", "check_ids"), "VocabParallelEmbedding")},
}


@dataclass
class _Target:
    """One submodule to replace: its name, the plan entry that matched it, its style and options."""

    name: str
    entry: str
    module: nn.Module
    style: str
    options: Dict[str, Any]


def _fail(entry: str, rule: str) -> ValueError:
    return ValueError(f"parallelize: plan entry {entry!r}: {rule}")


def _parse_value(entry: str, value: PlanValue) -> Tuple[str, Dict[str, Any]]:
    """(style, options) of one plan value: a style name or {"style": ..., **options}."""
    if isinstance(value, str):
        style, options = value, {}
    elif isinstance(value, Mapping) and "style" in value:
        options = dict(value)
        style = options.pop("style")
    else:
        raise _fail(entry, f"the value must be a style name or a dict with a 'style' key, got {value!r}")
    if style not in _STYLES:
        raise _fail(entry, f"unknown style {style!r}; styles: {sorted(_STYLES)}")
    return style, options


def _check_applicable(entry: str, name: str, module: nn.Module, style: str, options: Dict[str, Any]) -> None:
    """ValueError unless `style` (with `options`) applies to `module`."""
    kinds = _STYLES[style]
    kind = next((k for k in kinds if isinstance(module, k)), None)
    if kind is None:
        wanted = " or ".join(f"nn.{k.__name__}" for k in kinds)
        raise _fail(entry, f"style {style!r} applies to {wanted}, but {name!r} is {type(module).__name__}")
    allowed, _ = kinds[kind]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise _fail(entry, f"options {unknown} do not apply to style {style!r} on nn.{kind.__name__}; "
                           f"options: {list(allowed)}")
    if style == "rowwise" and options.get("sequence_parallel") and options.get("input_is_parallel") is False:
        raise _fail(entry, "sequence_parallel=True needs input_is_parallel=True")


def _match(module: nn.Module, plan: Mapping[str, PlanValue]) -> List[_Target]:
    """The submodules the plan names, in module order; ValueError for any entry that breaks a rule."""
    names = [name for name, _ in module.named_modules() if name]
    found: Dict[str, _Target] = {}
    for entry, value in plan.items():
        style, options = _parse_value(entry, value)
        hits = [name for name in names if fnmatch.fnmatchcase(name, entry)]
        if not hits:
            raise _fail(entry, f"matches no submodule (submodule names look like {names[:4]})")
        for name in hits:
            if name in found:
                raise _fail(entry, f"{name!r} is also matched by plan entry {found[name].entry!r}")
            sub = module.get_submodule(name)
            _check_applicable(entry, name, sub, style, options)
            found[name] = _Target(name, entry, sub, style, options)
    return [found[name] for name in names if name in found]


def _check_not_shared(module: nn.Module, targets: List[_Target]) -> None:
    """ValueError for a target that appears under two names, or whose parameters another module also uses
    (tied weights): replacing it in one place would silently untie it."""
    places: Dict[int, List[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        places.setdefault(id(sub), []).append(name)
    owners: Dict[int, List[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for t in targets:
        if len(places[id(t.module)]) > 1:
            raise _fail(t.entry, f"{t.name!r} is the same module as {places[id(t.module)][1:]} (shared modules "
                                 "cannot be split in one place only)")
        for pname, param in t.module.named_parameters():
            others = [o for o in owners[id(param)] if not o.startswith(t.name + ".")]
            if others:
                raise _fail(t.entry, f"{t.name}.{pname} is tied to {others} (tied parameters are not supported)")


def _builder(style: str, module: nn.Module) -> Callable[..., nn.Module]:
    """The tpflash layer's from_linear / from_embedding for this style and module type."""
    from ..layers import embedding, linear  # layers import parallel: import them when first needed
    kind = nn.Linear if isinstance(module, nn.Linear) else nn.Embedding
    cls_name = _STYLES[style][kind][1]
    cls = getattr(linear if kind is nn.Linear else embedding, cls_name)
    return cls.from_linear if kind is nn.Linear else cls.from_embedding


def parallelize(module: nn.Module, plan: Mapping[str, PlanValue], ps: Optional[ParallelState] = None) -> nn.Module:
    """Replace the submodules named by `plan` with tensor-parallel layers over `ps.tp_group` (default:
    the state from tpflash.parallel.init; with neither, tp=1) and return `module`, changed in place.

    Each rank keeps its shard of every replaced weight (padded with zeros where tp does not divide
    the width) and the full tensors are dropped: the values are moved, never re-initialised, so
    `full_state_dict(module)` equals the original state dict. Shapes seen by the caller's code:
    a colwise Linear returns [*, ceil(out/tp)] (or [*, out] with gather_output=True); a rowwise
    Linear takes that (or [*, in] with input_is_parallel=False) and returns [*, out] summed over tp;
    embeddings return [*, dim]. Plan styles and options: this module's docstring. No communication:
    each rank slices its own copy, so every rank must hold the same weights (same seed or a load).
    Raises ValueError (naming the plan entry) for an entry that matches no submodule, a style that
    does not apply to the module it matches, an unknown option, or a shared or tied module.
    """
    targets = _match(module, plan)
    _check_not_shared(module, targets)
    group = ps.tp_group if ps is not None else resolve_tp_group(None)
    replacements = []
    for t in targets:
        try:
            new = _builder(t.style, t.module)(t.module, process_group=NO_GROUP if group is None else group,
                                              **t.options)
        except (TypeError, ValueError) as e:
            raise _fail(t.entry, f"cannot build {t.style!r} from {t.name!r}: {e}") from e
        new.train(t.module.training)
        replacements.append((t.name, new))
    for name, new in replacements:  # nothing is changed until every replacement is built
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, new)
    return module
