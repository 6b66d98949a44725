"""Sequence-parallel GEMMs overlapped with copy-engine transfers, and when they run.

Under sequence parallelism a column-parallel GEMM needs the all-gathered input and a row-parallel
GEMM ends in a reduce-scatter; done one after the other, the GPU waits for each collective.
`all_gather_linear` and `linear_reduce_scatter` compute what the serial layers compute, one GEMM
per rank's rows while the GPUs' copy engines move the other ranks' rows
(tpflash.parallel.peer_collectives). Copy engines leave the SMs to the GEMMs: on 2 H200s a GEMM
beside a copy-engine transfer of its activation ran 4% slower, beside an SM-kernel copy (what
NCCL's kernels are) 30% slower (docs/overlap.md). So one piece per rank is enough, and each piece
is one GEMM over the weights stacked (q/k/v, up/gate) as in tpflash.layers.autocast_linear. How
each direction runs: tpflash.parallel.overlap_gemms. Where the GPUs cannot map each other's memory
(CPU, gloo, GPUs of several hosts, TPFLASH_COMM_BACKEND=nccl) the same Functions run over the
group's own collectives with nothing overlapped: that is what the CPU tests run; the copy engines
are tested on 2 GPUs.

When the overlapped path runs, decided where the layers are built or captured, never per call:
  * a layer's own `overlap=True/False` (`set_overlap(model, enabled)` sets it for a whole model);
  * for layers with overlap=None (the default): TPFLASH_OVERLAP=1 / 0, read once at import;
  * with neither, the default: on for the work a CUDA graph captures (GraphedBlocks decides once
    per capture, `capture_decision`, and hands the decision to the blocks' layers for the capture:
    `overlapping_for_capture`) where the copy engines reach the tp group, the setup where it was
    measured faster than serial collectives; off everywhere else.
Results are the same either way up to the order of floating-point sums. Process group: the tp
group passed in.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..layers.weight_casts import PendingCast
from . import peer_collectives
from .held_work import HeldWork
from .overlap_gemms import _ColumnLinearOverPeers, _RowLinearOverPeers
from .overlap_transfers import copy_engines_reach, kept_input_part, linear_compute_dtype
from .state import group_size

__all__ = ["all_gather_linear", "capture_decision", "copy_engines_reach", "gathered_input_part", "keeps_gathered_input",
           "layer_overlaps", "linear_compute_dtype", "linear_reduce_scatter", "overlapping_for_capture", "set_overlap"]

_ENV = "TPFLASH_OVERLAP"
_BACKEND_ENV = "TPFLASH_OVERLAP_BACKEND"  # only "copy_engine" (or "auto") is accepted: one design


def _env_setting() -> Optional[bool]:
    """TPFLASH_OVERLAP: "1"/"true"/"on"/"yes" on, any other value off, unset None. Raises ValueError
    for a TPFLASH_OVERLAP_BACKEND other than the copy engines."""
    backend = os.environ.get(_BACKEND_ENV, "").strip().lower()
    if backend not in ("", "auto", "copy_engine"):
        raise ValueError(f"{_BACKEND_ENV}={backend!r} is not supported: tpflash overlaps communication through "
                         f"the copy engines only (docs/overlap.md, \"Designs not kept\"). Unset {_BACKEND_ENV}; "
                         f"{_ENV}=1 or 0 turns overlap on or off")
    env = os.environ.get(_ENV, "").strip().lower()
    return (env in ("1", "true", "on", "yes")) if env else None


ENVIRONMENT_SETTING: Optional[bool] = _env_setting()  # TPFLASH_OVERLAP at import: None when unset


def layer_overlaps(overlap: Optional[bool]) -> bool:
    """Whether a layer whose overlap flag is `overlap` takes the overlapped path: its flag, else the
    environment's (TPFLASH_OVERLAP), else off."""
    return bool(ENVIRONMENT_SETTING if overlap is None else overlap)


def _overlap_flags(module: nn.Module) -> List[nn.Module]:
    """module and its submodules that carry an overlap flag (Column/RowParallelLinear, GPT's head)."""
    return [m for m in module.modules() if "overlap" in vars(m) and (m.overlap is None or isinstance(m.overlap, bool))]


def set_overlap(module: nn.Module, enabled: Optional[bool]) -> None:
    """Set the overlap flag of every layer of `module` that has one: True / False win over TPFLASH_OVERLAP
    and over a capture's default; None returns them to those defaults. A CUDA graph captured after it
    keeps the choice."""
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"set_overlap(enabled={enabled!r}): enabled must be True, False or None")
    for m in _overlap_flags(module):
        m.overlap = enabled



def capture_decision(x: torch.Tensor, group) -> bool:
    """Whether work captured for input x over the tp group overlaps where its layers leave it to the
    default: TPFLASH_OVERLAP if set, else where the copy engines reach the group. Asks the group
    once (peer_collectives.peer_access): every rank must call it together, outside capture."""
    if ENVIRONMENT_SETTING is not None:
        return ENVIRONMENT_SETTING
    return group_size(group) > 1 and copy_engines_reach(x, group)


@contextlib.contextmanager
def overlapping_for_capture(blocks: Sequence[nn.Module], decision: bool):
    """The warm-up and capture of a CUDA graph of `blocks` (GraphedBlocks): their layers left to the
    default (overlap=None) take `decision` (capture_decision) for the capture, and get None back
    after it; the replays keep what was captured. Serial collectives go through the copy engines
    where the comm backend says so for captured work (peer_collectives.for_graph_capture). Yields
    whether any of the blocks' layers overlaps in the capture."""
    flagged = [m for b in blocks for m in _overlap_flags(b)]
    defaulted = [m for m in flagged if m.overlap is None]
    for m in defaulted:
        m.overlap = bool(decision)
    try:
        with peer_collectives.for_graph_capture():
            yield any(m.overlap for m in flagged)
    finally:
        for m in defaulted:
            m.overlap = None


# ---- entry points ----------------------------------------------------------------------------------

def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Optional[Sequence[Optional[torch.Tensor]]] = None, group=None,
                      save_gathered_input: Optional[bool] = None,
                      held: Optional[HeldWork] = None, grad_ports: Sequence[torch.Tensor] = (),
                      casts: Optional[PendingCast] = None) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i) for each i], the gather overlapped with the GEMMs.

    x_local: [s/tp, b, in] (sequence-first, this rank's tokens); W_i: [out_i/tp, in]; returns
    [s, b, out_i/tp] per weight. Several weights share one gathered input (q/k/v, up/gate).
    save_gathered_input=True keeps the gathered input for the backward (tp times the memory of
    x_local; inside a CUDA graph's capture in a buffer of the layer's own, peer_collectives.kept_buffer,
    elsewhere copied out of the peer buffers); False keeps only x_local and gathers it again in the
    backward, beside the input-gradient GEMMs; None (default): `keeps_gathered_input`. held: over a
    kept input, the weight gradient's GEMM may be held back for a later layer's waits
    (tpflash.parallel.held_work). grad_ports: tp - 1 outputs of x_local's producer, shaped like it,
    whose gradients it adds to x_local's (a norm's `grad_ports`): where the input gradient's
    reduce-scatter leaves its parts unsummed (inside a CUDA graph capture), this rank's part is
    x_local's gradient and the received ones are the ports', and no pass adds them here; otherwise
    the ports get no gradient. casts: a block's weight casts for this forward
    (tpflash.layers.weight_casts), where the GEMMs find the weights and biases cast. Process group:
    `group` (None: tp=1).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases")
    if group_size(group) == 1:
        return [torch.nn.functional.linear(x_local, w, b) for w, b in zip(weights, biases)]
    if any(b is not None for b in biases):  # one stacked bias: zeros (no gradient) where a weight has none
        biases = [torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
                  for w, b in zip(weights, biases)]
    keep = keeps_gathered_input(save_gathered_input)
    if grad_ports and len(grad_ports) != group_size(group) - 1:
        raise ValueError(f"got {len(grad_ports)} gradient ports; the input gradient's reduce-scatter over "
                         f"{group_size(group)} ranks has {group_size(group) - 1} received parts")
    return list(_ColumnLinearOverPeers.apply(x_local, group, keep, held, casts, len(weights), len(grad_ports),
                                             *grad_ports, *weights, *biases))


def keeps_gathered_input(save_gathered_input: Optional[bool]) -> bool:
    """Whether an overlapped column GEMM keeps its all-gathered input for the backward: the layer's
    save_gathered_input where set, else yes. Gathering it again keeps only the local shard (1/tp of
    the memory) but moves (tp-1)/tp of the activation through the copy engines once more in each
    backward and copies this rank's rows beside the others'; a kept input also lets the MLP's up
    projection hold its weight gradient for the output projection's waits. Keeping made llama-1b's
    tp=4 step 6% shorter and gpt-2.7b's and llama-1b's tp=2 steps 1.1-1.5% shorter
    (docs/performance.md, "TP efficiency")."""
    return True if save_gathered_input is None else bool(save_gathered_input)


def gathered_input_part(like: torch.Tensor, owner: torch.Tensor, group,
                        save_gathered_input: Optional[bool] = None) -> Optional[torch.Tensor]:
    """Where `all_gather_linear(x, [owner, ...], group=group, save_gathered_input=...)` finds this rank's
    rows of x without copying them: in the work a CUDA graph captures over copy engines that reach
    the group, a kept input lies in a buffer of the layer's own (peer_collectives.kept_buffer) and
    this rank's rows have their place in it. Returned as a [like.shape] tensor of the dtype the GEMMs
    compute in for an x like `like` (the producer of x, e.g. the norm before the layer, writes x
    into it); None where the gather keeps no such buffer. Process group: `group`."""
    if group_size(group) == 1 or not keeps_gathered_input(save_gathered_input):
        return None
    return kept_input_part(like, group, owner)


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group=None,
                          bias: Optional[torch.Tensor] = None, held: Optional[HeldWork] = None,
                          parts: bool = False, casts: Optional[PendingCast] = None,
                          grad_held_for: Optional[HeldWork] = None
                          ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """reduce_scatter_along_seq(F.linear(h, weight)) + bias, the GEMMs overlapped with the reduce-scatter.

    h: [s, b, in/tp] (sequence-first); weight: [out, in/tp]; bias: [out] or None, added once per
    token in this rank's own GEMM (its gradient is this rank's tokens' part: a replicated bias
    needs its gradient summed over tp, e.g. through comm.copy_to_tp_region); returns this rank's
    summed tokens [s/tp, b, out]. held: work held for this layer's waits (tpflash.parallel.held_work),
    run in the forward while the last parts travel and in the backward while the peers' parts of
    grad_y do. parts: where the transfers go through the copy engines inside a graph capture
    (peer_collectives.PeerReduceScatter.finish_parts), return the sum's parts unsummed, a tuple
    [s/tp, b, out] each, this rank's own first (the only one with a gradient), for a consumer that
    adds them in its own pass (kernels.layer_norm / rms_norm take them as x); elsewhere the sum.
    casts: as in all_gather_linear. grad_held_for: where the weight gradient may be held back, over the
    gathered grad_y kept for it, to be computed with a held one of its shape in one batched GEMM
    (tpflash.parallel.held_work), or None. Raises ValueError, before any collective, when s is not divisible
    by tp or the bias has the wrong size. Process group: `group`.
    """
    world = group_size(group)
    if world == 1:
        return torch.nn.functional.linear(h, weight, bias)
    if h.shape[0] % world:
        raise ValueError(f"sequence length {h.shape[0]} (dim 0 of {tuple(h.shape)}) is not divisible by tp={world}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the weight {tuple(weight.shape)}: "
                         f"it must be [{weight.shape[0]}] (one value per output feature)")
    ys = _RowLinearOverPeers.apply(h, weight, bias, group, held, parts, casts, grad_held_for)
    return ys if len(ys) > 1 else ys[0]
