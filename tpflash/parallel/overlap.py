"""Communication/computation overlap for sequence-parallel GEMMs: the switch, and which backend runs.

Under sequence parallelism a column-parallel GEMM needs the all-gathered input and a row-parallel
GEMM ends in a reduce-scatter; done naively the GPU waits for each collective. The entry points
here, `all_gather_linear` and `linear_reduce_scatter`, compute the same as the serial layers with
the collective pipelined with the GEMMs by one of three backends (TPFLASH_OVERLAP_BACKEND):

  "copy_engine"  one GEMM per rank's rows beside copy-engine transfers (tpflash.parallel.peer_overlap);
                 where the GPUs cannot map each other's memory, the same GEMMs over the group's
                 collectives, not overlapped
  "pieces"       each rank's shard cut into k pieces, one asynchronous NCCL/gloo collective each
                 (tpflash.parallel.pieces_overlap; TPFLASH_OVERLAP_PIECES sets k, 4)
  "symm_mem"     PyTorch's symmetric-memory collective matmuls (tpflash.parallel.symm_overlap;
                 CUDA only, "pieces" elsewhere)
  "auto"         (default) copy_engine where the copy engines reach, else pieces

The switch: TPFLASH_OVERLAP=1/0, or `overlap_comm(True/False)` inside a `with` block; layers built
with `overlap=None` ask at every forward (`resolve_overlap`). Unset, overlap is on only for the work
CUDA graphs capture over GPUs that map each other's memory, with the "copy_engine" backend, the one
variant measured faster than serial collectives (docs/overlap.md). Results are the same either way
up to the order of floating-point sums. The dtype helpers below are shared by the backends.
"""
from __future__ import annotations

import contextlib
import os
from typing import List, Optional, Sequence

import torch

from ..layers.weight_casts import stacked_cast
from . import peer_collectives
from .state import group_size

_ENV = "TPFLASH_OVERLAP"
_forced: List[bool] = []  # stack of `overlap_comm` settings; the innermost wins


def _explicit_setting() -> Optional[bool]:
    """The innermost `overlap_comm` setting, else TPFLASH_OVERLAP ("1"/"true"/"on"/"yes" on, anything
    else off), else None (unset)."""
    if _forced:
        return _forced[-1]
    env = os.environ.get(_ENV, "").strip().lower()
    return (env in ("1", "true", "on", "yes")) if env else None


def overlap_enabled() -> bool:
    """Whether overlap was asked for everywhere: the innermost `overlap_comm` setting, else
    TPFLASH_OVERLAP, else False. (Unasked, `resolve_overlap` still overlaps the work CUDA graphs
    capture where the copy engines can carry it: its docstring.)"""
    return bool(_explicit_setting())


@contextlib.contextmanager
def overlap_comm(enabled: bool = True):
    """Within the block, layers built with overlap=None use (or, with False, skip) the pipelined path."""
    _forced.append(bool(enabled))
    try:
        yield
    finally:
        _forced.pop()


_BACKENDS = ("auto", "pieces", "symm_mem", "copy_engine")


def overlap_backend(x: Optional[torch.Tensor] = None, group=None) -> str:
    """How overlapped layers communicate (TPFLASH_OVERLAP_BACKEND): "copy_engine" (one GEMM per rank's
    rows beside copy-engine transfers, tpflash.parallel.peer_overlap; where the GPUs cannot map each
    other's memory, the same GEMMs over the group's collectives, not overlapped), "pieces" (NCCL/gloo
    collectives per piece, tpflash.parallel.pieces_overlap) or "symm_mem" (PyTorch's symmetric-memory collective
    matmuls, tpflash.parallel.symm_overlap; CUDA only, "pieces" elsewhere). "auto" (the default):
    "copy_engine" for x over group where its GPUs map each other's memory and TPFLASH_COMM_BACKEND
    is not "nccl" (the only variant measured faster than serial collectives: docs/overlap.md),
    else "pieces". With no x, "auto" itself."""
    backend = os.environ.get("TPFLASH_OVERLAP_BACKEND", "auto").strip().lower()
    if backend not in _BACKENDS:
        raise ValueError(f"TPFLASH_OVERLAP_BACKEND={backend!r} must be one of {_BACKENDS}")
    if backend == "auto" and x is not None:
        return "copy_engine" if _copy_engines_reach(x, group) else "pieces"
    return backend


def _copy_engines_reach(x: torch.Tensor, group) -> bool:
    return peer_collectives.comm_backend() != "nccl" and peer_collectives.reachable(x, group)


def _use_symm_mem(x: torch.Tensor, group) -> bool:
    if overlap_backend(x, group) != "symm_mem":
        return False
    from . import symm_overlap
    return symm_overlap.available(x)


def resolve_overlap(flag: Optional[bool], x: Optional[torch.Tensor] = None, group=None) -> bool:
    """Whether a layer pipelines its collectives now: its explicit `overlap` flag, else the global
    setting (`overlap_comm`, TPFLASH_OVERLAP), else the default: on for the work CUDA graphs capture
    (GraphedBlocks: `peer_collectives.for_graph_capture`) when the "copy_engine" backend serves x over
    group with the copy engines; off elsewhere, where no variant measured faster than serial
    collectives (docs/overlap.md). x/group: the layer's input and tp group (None: no default)."""
    if flag is not None:
        return bool(flag)
    setting = _explicit_setting()
    if setting is not None:
        return setting
    return (x is not None and peer_collectives.capturing_for_graphs()
            and overlap_backend(x, group) == "copy_engine" and _copy_engines_reach(x, group))


# ---- dtype handling under autocast -----------------------------------------------------------------

def linear_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in for input x here: the autocast dtype when autocast is on
    (autocast leaves float64 alone), else x's."""
    dev = x.device.type
    if (dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and x.is_floating_point()
            and x.dtype != torch.float64):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else stacked_cast([t], dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[*, feat] -> [rows, feat] (a view when t is contiguous)."""
    return t.reshape(-1, t.shape[-1])


def _no_autocast(x: torch.Tensor):
    return torch.autocast(x.device.type, enabled=False)


# ---- public entry points ---------------------------------------------------------------------------

def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Optional[Sequence[Optional[torch.Tensor]]] = None, group=None,
                      save_gathered_input: Optional[bool] = None) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i) for each i], the gather pipelined with the GEMMs.

    x_local: [s/tp, b, in] (sequence-first, this rank's tokens); W_i: [out_i/tp, in]; returns
    [s, b, out_i/tp] per weight. Several weights share one gathered input (q/k/v, up/gate).
    save_gathered_input=False keeps only x_local for backward (1/tp of the memory) and re-gathers
    it there, hidden behind the input-gradient GEMMs; None (default): the backend's choice, which
    re-gathers under "copy_engine" (the transfer rides on the copy engines) and keeps the gathered
    input otherwise (an NCCL all-gather would take SMs from the GEMMs). Process group: `group`
    (None: tp=1).
    """
    biases = [None] * len(weights) if biases is None else list(biases)
    if len(biases) != len(weights):
        raise ValueError(f"got {len(weights)} weights but {len(biases)} biases")
    if group_size(group) == 1:
        return [torch.nn.functional.linear(x_local, w, b) for w, b in zip(weights, biases)]
    all_or_no_bias = len({b is None for b in biases}) == 1
    if overlap_backend(x_local, group) == "copy_engine" and all_or_no_bias:
        from . import peer_overlap
        return peer_overlap.all_gather_linear(x_local, weights, biases, group, bool(save_gathered_input))
    save_gathered_input = True if save_gathered_input is None else save_gathered_input
    if _use_symm_mem(x_local, group):
        from . import symm_overlap
        return symm_overlap.all_gather_linear(x_local, weights, biases, group)
    from . import pieces_overlap
    return pieces_overlap.all_gather_linear(x_local, weights, biases, group, save_gathered_input)


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group=None,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """reduce_scatter_along_seq(F.linear(h, weight)) + bias, the GEMM pipelined with the reduce-scatter.

    h: [s, b, in/tp] (sequence-first); weight: [out, in/tp]; bias: [out] or None, added once to the
    sum in the output's dtype (its gradient is this rank's tokens' part: a replicated bias needs
    its gradient summed over tp, e.g. through comm.copy_to_tp_region); returns this rank's summed
    tokens [s/tp, b, out]. Raises ValueError when s is not divisible by tp. Process group: `group`.
    """
    world = group_size(group)
    if world == 1:
        return torch.nn.functional.linear(h, weight, bias)
    if h.shape[0] % world:
        raise ValueError(f"sequence length {h.shape[0]} (dim 0 of {tuple(h.shape)}) is not divisible by tp={world}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not match the weight {tuple(weight.shape)}: "
                         f"it must be [{weight.shape[0]}] (one value per output feature)")
    if overlap_backend(h, group) == "copy_engine":  # the bias rides in this rank's own GEMM's epilogue
        from . import peer_overlap
        return peer_overlap.linear_reduce_scatter(h, weight, group, bias)
    if _use_symm_mem(h, group):
        from . import symm_overlap
        y = symm_overlap.linear_reduce_scatter(h, weight, group)
    else:
        from . import pieces_overlap
        y = pieces_overlap.linear_reduce_scatter(h, weight, group)
    from ..layers.autocast_linear import add_bias  # layers import this module
    return add_bias(y, bias)
