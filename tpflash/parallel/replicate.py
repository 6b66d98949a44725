"""Replication over the data-parallel dimension, with the gradients' all-reduce overlapped with the backward.

Where FSDP is not used (`fsdp=auto` keeps whole copies where they fit, tpflash.train.build.fsdp_choice),
every dp rank holds the same parameters (its tp shards) and the gradients must be averaged over
the dp group before the optimizer step. Done after the backward, that all-reduce is time the GPUs
spend on nothing else. PyTorch's `DistributedDataParallel` instead all-reduces buckets of ~25 MB
as their gradients become ready, while the backward goes on computing the earlier layers, and
with `gradient_as_bucket_view` the gradients then live in those buckets (each new gradient is
copied in once, the divide by dp riding on the copy; no copy back). So the replicated path uses
it rather than a reducer of its own. The price is memory: the buckets stay allocated between
steps (docs/performance.md, "FSDP against replication").

It composes with tensor parallelism because tp parameters are plain local tensors: DDP over
`ps.dp_cp_group` averages each tp shard with the same shard of its dp * cp peers (cp ranks hold
the same parameters, each with gradients from its own tokens, see context_parallel.py; at cp=1
the group is `ps.dp_group`), and the tp and cp collectives inside the model run on their own
groups. With CUDA-graphed blocks the blocks' gradients arrive together, when the graphed
backward returns, and DDP's buckets are reduced from there: no overlap with the blocks'
backward, only with the embedding's.
"""
from __future__ import annotations

import inspect

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from .state import ParallelState


def replicate_over_dp(model: nn.Module, ps: ParallelState,
                      bucket_cap_mb: float = 25.0) -> DistributedDataParallel:
    """`model` wrapped in DistributedDataParallel over the dp * cp ranks, `ps.dp_cp_group` (`ps.dp_group`
    at cp=1; at dp * cp = 1 it works, but has nothing to average: the trainer does not wrap there).

    Call it on every rank of the job (the constructor checks the parameters' shapes across the group
    and broadcasts its rank 0's values, collectives over `ps.dp_cp_group`), after the model's
    weights are loaded and its CUDA graphs captured. Run the training forward through the
    returned wrapper (other uses, evaluation, checkpoints, go to `model` itself), and wrap the
    forward and backward of every micro-batch but the last of a step in its `no_sync()`.
    Every parameter that needs a gradient must get one in every training backward (DDP's rule
    without `find_unused_parameters`); a model that breaks it gets DDP's error at the next step."""
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be > 0")
    # tpflash's buffers (rotary tables) are the same on every rank: no broadcast before each forward.
    # torch 2.13 renamed the switch; 2.11 (the GPU machines) knows only the old name.
    no_buffer_sync = {_BUFFER_SYNC_ARG: False}
    return DistributedDataParallel(model, process_group=ps.dp_cp_group, bucket_cap_mb=bucket_cap_mb,
                                   gradient_as_bucket_view=True, **no_buffer_sync)


_DDP_ARGS = inspect.signature(DistributedDataParallel).parameters
_BUFFER_SYNC_ARG = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
