"""FSDP2 (`fully_shard`) over the data- and context-parallel ranks, composed with tensor parallelism.

tp parameters are plain local tensors (each tp rank's shard, see sharding.py), so sharding a
module over `ps.dp_cp_mesh` splits every tp rank's *local* tensors across its dp * cp peers (the
ranks with the same tp rank): 2-D ((dp x cp) x tp) sharding with no DTensor on the tp side. cp
ranks hold the same parameters as dp peers do, so they shard them too: a long-context job at
dp=1 does not keep a whole copy per cp rank. At cp=1 the mesh is `ps.dp_mesh`. Inside a forward
FSDP hands the layers plain unsharded local tensors again, so tpflash's explicit tp (and cp)
collectives run unchanged.

Wrapping: each transformer block becomes one FSDP unit (one all-gather / reduce-scatter), then
the root takes what is left (embeddings, final norm, head). Embeddings and head stay in the root
unit on purpose: GPT-2 ties the head to the embedding, and a parameter used outside its unit's
forward would be seen sharded.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .state import ParallelState, get_default_state

WrapPolicy = Callable[..., bool]  # FSDP1 auto_wrap_policy: policy(module, recurse, nonwrapped_numel) -> bool
_AUTO = "auto"


def block_wrap_policy(block_classes: Iterable[Type[nn.Module]]) -> WrapPolicy:
    """FSDP1-style auto_wrap_policy that wraps every instance of `block_classes` (FSDP1 and `apply_fsdp`)."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=set(block_classes))


def size_wrap_policy(min_num_params: int = 100_000_000) -> WrapPolicy:
    """FSDP1-style auto_wrap_policy that wraps any module holding >= min_num_params not yet wrapped."""
    if min_num_params < 1:
        raise ValueError(f"min_num_params={min_num_params} must be >= 1")
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
    return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)


def _as_class_tuple(classes) -> Tuple[type, ...]:
    if classes is None:
        return ()
    return tuple(classes) if isinstance(classes, (list, tuple, set, frozenset)) else (classes,)


def select_units(model: nn.Module, block_classes=None, auto_wrap_policy: Optional[WrapPolicy] = None) -> list:
    """The submodules (children before parents, root excluded) that become FSDP units.

    Priority: `block_classes`, then `auto_wrap_policy` (called as FSDP1 does for its final
    decision: recurse=False, nonwrapped_numel = parameters below the module not already in a
    chosen unit), then `model.block_class`. With none of them only the root is a unit.
    """
    classes = _as_class_tuple(block_classes)
    if not classes and auto_wrap_policy is None:
        classes = _as_class_tuple(getattr(model, "block_class", None))
    if classes:
        auto_wrap_policy = block_wrap_policy(classes)
    if auto_wrap_policy is None:
        return []
    units: list = []
    wrapped: Set[int] = set()  # ids of parameters owned by a chosen unit

    def visit(module: nn.Module, is_root: bool) -> None:
        for child in module.children():
            visit(child, False)
        if is_root:
            return
        free = sum(p.numel() for p in module.parameters() if id(p) not in wrapped)
        if free and auto_wrap_policy(module=module, recurse=False, nonwrapped_numel=free):
            units.append(module)
            wrapped.update(id(p) for p in module.parameters())

    visit(model, True)
    return units


def hsdp_mesh(ps: ParallelState, replicas: int) -> DeviceMesh:
    """A 2-D ("dp_replicate", "dp_shard") mesh: parameters replicated over `replicas` groups, sharded within.

    Collective (creates process groups): call on every rank. Ranks keep ps's order, so
    dp rank d = replica * (dp / replicas) + shard; put replicas across nodes. cp=1 only: with
    context parallelism ValueError (before any group is made).
    """
    if replicas < 1 or ps.dp_size % replicas != 0:
        raise ValueError(f"hsdp_replicas={replicas} must be >= 1 and divide dp={ps.dp_size}")
    if replicas > 1 and ps.cp_size > 1:
        raise ValueError(f"hsdp_replicas={replicas} with cp={ps.cp_size} is not supported: use hsdp_replicas=1 "
                         "(FSDP over the dp * cp ranks) or cp=1")
    mesh = init_device_mesh(ps.device.type, (replicas, ps.dp_size // replicas, ps.tp_size),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    return mesh["dp_replicate", "dp_shard"]


def apply_fsdp(model: nn.Module, ps: Optional[ParallelState] = None, *,
               param_dtype: Union[torch.dtype, None, str] = _AUTO, reduce_dtype: Optional[torch.dtype] = torch.float32,
               reshard_after_forward: bool = True, cpu_offload: bool = False,
               block_classes: Union[Type[nn.Module], Sequence[Type[nn.Module]], None] = None,
               auto_wrap_policy: Optional[WrapPolicy] = None, hsdp_replicas: int = 1,
               mesh: Optional[DeviceMesh] = None, prefetch: bool = True) -> nn.Module:
    """Shard `model` with FSDP2 `fully_shard` over the dp * cp ranks of `ps` (default: the state from `init`).

    Every unit chosen by `select_units` (transformer blocks by default) is sharded, then the root.
    Each tp rank's local parameter shards are split (dim 0) over `ps.dp_cp_mesh` (its dp group at
    cp=1); gradients are reduce-scattered (averaged) over those dp * cp ranks in `reduce_dtype`.
    `param_dtype` is the compute dtype of the all-gathered parameters ("auto": bf16 on CUDA, the
    parameters' own dtype on CPU; None: never cast); the sharded master parameters keep their
    dtype. `cpu_offload` keeps sharded parameters, gradients and optimizer state in (pinned) host
    memory; it is a no-op on CPU. `hsdp_replicas` > 1 gives HSDP (see `hsdp_mesh`; not with
    cp > 1); `mesh` overrides the dp * cp mesh (1-D: FSDP, 2-D (replicate, shard): HSDP).
    `prefetch`: each unit's forward starts the all-gather of the next sibling unit (block i+1 during
    block i) and its backward that of the previous one, as soon as it runs rather than when the host
    reaches the next unit: an eager step whose host runs behind the GPU still overlaps them.
    Modifies `model` in place and returns it.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    ps = ps if ps is not None else get_default_state()
    if ps is None:
        raise ValueError("apply_fsdp needs a ParallelState: call tpflash.parallel.init(...) first or pass ps=")
    if mesh is not None and hsdp_replicas != 1:
        raise ValueError(f"pass either mesh= or hsdp_replicas={hsdp_replicas}, not both")
    if param_dtype == _AUTO:
        param_dtype = torch.bfloat16 if ps.device.type == "cuda" else None
    if mesh is None:
        mesh = hsdp_mesh(ps, hsdp_replicas) if hsdp_replicas != 1 else ps.dp_cp_mesh
    offload = CPUOffloadPolicy(pin_memory=True) if cpu_offload and ps.device.type == "cuda" else OffloadPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload,
                  mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    units = select_units(model, block_classes, auto_wrap_policy)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    if prefetch:
        for chain in _sibling_chains(model, units):
            for earlier, later in zip(chain, chain[1:]):
                earlier.set_modules_to_forward_prefetch([later])
                later.set_modules_to_backward_prefetch([earlier])
    return model


def _sibling_chains(model: nn.Module, units: Sequence[nn.Module]) -> List[List[nn.Module]]:
    """The units grouped by parent module, in module order (a model's blocks are one chain): the order
    in which a forward runs them, reversed in the backward."""
    chosen = {id(u) for u in units}
    chains = []
    for parent in model.modules():
        chain = [child for child in parent.children() if id(child) in chosen]
        if len(chain) > 1:
            chains.append(chain)
    return chains
