"""Global-norm clipping over all shards (the dp reduction itself is FSDP's or DDP's: tpflash.parallel).

The global norm is the norm of the *full* model's gradient, the same number on every rank:
tp-sharded parameters (those named in a module's `tp_shard_specs`) contribute their local
squares summed over the tp group; parameters replicated over tp count once (their gradients are
equal on every tp rank); under FSDP every gradient is also a dp shard, so squares are summed
over the dp group too.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.local_adamw import LocalShardAdamW
from ..parallel.sharding import iter_sharded


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The locally held values of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def tp_sharded_param_ids(model: nn.Module) -> Set[int]:
    """ids of the parameters split over tp (from the modules' tp_shard_specs)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {id(params[key]) for key, _, _ in iter_sharded(model) if key in params}


def _grads(params: Iterable[torch.nn.Parameter]) -> List[Tuple[torch.nn.Parameter, torch.Tensor]]:
    return [(p, p.grad) for p in params if p.grad is not None]


def _sum_of_squares(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """sum of squares of all `grads` in fp32, a few fused kernels rather than one per tensor."""
    by_kind = {}
    for g in grads:
        g = local_tensor(g).detach()
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_kind.values():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        total = total + torch.stack(norms).square().sum().to(device)
    return total


def global_grad_norm(model: nn.Module, tp_group: Optional[dist.ProcessGroup],
                     dp_group: Optional[dist.ProcessGroup], grads_sharded_over_dp: bool,
                     sharded_ids: Optional[Set[int]] = None,
                     params: Optional[Iterable[torch.nn.Parameter]] = None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (fp32 scalar on the grads' device), equal on all ranks.

    grads_sharded_over_dp: each dp rank holds a disjoint part of the gradients (FSDP's shards, or
    zero1's owned parameters, passed as `params`; default: all of the model's), summed over dp."""
    sharded_ids = tp_sharded_param_ids(model) if sharded_ids is None else sharded_ids
    pairs = _grads(model.parameters() if params is None else params)
    device = pairs[0][1].device if pairs else torch.device("cpu")
    sums = torch.stack([  # [tp-sharded, replicated over tp]
        _sum_of_squares([g for p, g in pairs if id(p) in sharded_ids], device),
        _sum_of_squares([g for p, g in pairs if id(p) not in sharded_ids], device)])
    if grads_sharded_over_dp and dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        sharded = sums[:1].clone()
        dist.all_reduce(sharded, group=tp_group)
        sums = torch.cat([sharded, sums[1:]])
    return sums.sum().sqrt()


def clip_grads_(params: Iterable[torch.nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients by min(1, max_norm / total_norm) (no host sync: the factor stays a tensor)."""
    if max_norm <= 0:
        return
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    by_device = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), group in by_device.items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))


def _step_divides_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether optimizer.step() divides each gradient by `optimizer.grad_scale` as it reads it: torch's
    fused Adam/AdamW (the protocol torch.amp.GradScaler uses), over plain tensors or, as LocalShardAdamW,
    over the local shards of DTensor parameters, with no grad_scale already set (by a GradScaler)."""
    groups = optimizer.param_groups
    plain = isinstance(optimizer, LocalShardAdamW) or all(
        type(p) in (torch.nn.Parameter, torch.Tensor) for g in groups for p in g["params"])
    return (isinstance(optimizer, torch.optim.Adam) and getattr(optimizer, "_step_supports_amp_scaling", False)
            and not hasattr(optimizer, "grad_scale") and all(g.get("fused") for g in groups) and plain)


def clipped_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter], total_norm: torch.Tensor,
                 max_norm: float) -> None:
    """optimizer.step() on the gradients scaled by min(1, max_norm / total_norm) (max_norm <= 0: not
    clipped); the gradients are left scaled. A fused torch Adam/AdamW does the scaling inside its own
    kernel: it is handed max(1, total_norm / max_norm) as `grad_scale`, divides each gradient by it as
    it reads it and writes it back scaled. That saves clip_grads_'s own read of every gradient (5.2 GB
    on a gpt-1.3b step). Other optimizers, and torch's AdamW over DTensor parameters, get clip_grads_,
    then step()."""
    if not isinstance(total_norm, torch.Tensor):
        raise TypeError(f"total_norm must be a tensor (as global_grad_norm returns), got {type(total_norm).__name__} "
                        f"{total_norm!r}")
    if max_norm > 0 and _step_divides_grads(optimizer):
        optimizer.grad_scale = ((total_norm.float() + 1e-6) / max_norm).clamp(min=1.0)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    clip_grads_(params, total_norm, max_norm)
    optimizer.step()
