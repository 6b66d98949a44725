"""AdamW whose update runs on the local shards of DTensor parameters.

torch's AdamW over DTensor parameters (FSDP2's, and zero3's: tpflash.parallel.zero3) sends its one
fused (or foreach) kernel call through DTensor's dispatch, which builds a sharding spec for every
parameter, gradient and moment on every step: on a llama-1b zero3 step that was most of the host's
Python work outside the CUDA graphs. AdamW is elementwise, so each rank's shard updates on its own;
this class hands torch's own update (the same `torch.optim.adam.adam`, the same fused kernel) the
local tensors under the DTensors instead. The parameters, the state and its state_dict stay DTensors,
so checkpoints (DCP) and every other reader see exactly what torch's AdamW keeps.
"""
from __future__ import annotations

from typing import List

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    # a DTensor's local shard without DTensor.to_local()'s autograd function (the update runs under no_grad,
    # and to_local costs the host about as much as the dispatch this avoids)
    return getattr(t, "_local_tensor", t)


class LocalShardAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, the same arguments and results, updating each DTensor parameter's local shard
    (a plain parameter is its own shard). Every placement of a DTensor parameter must hold whole
    values on this rank (Shard or Replicate, as FSDP2 and zero3 place them), never Partial sums."""

    def _init_group(self, group, params: List[torch.Tensor], grads: List[torch.Tensor], *state_lists):
        has_complex = super()._init_group(group, params, grads, *state_lists)
        for tensors in (params, grads, *state_lists):
            tensors[:] = [_local(t) for t in tensors]
        return has_complex
