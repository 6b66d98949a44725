"""Tensor-parallel feed-forward block: column-parallel up (and gate) projection, row-parallel down."""
from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from .. import kernels
from ..parallel.held_work import HeldWork
from ..parallel.state import group_size, resolve_tp_group, sublayer_group
from ..kernels.dispatch import requested_backend, use_backend
from ..kernels.fused_dense import fused_dense_gelu_dense
from ..kernels.fp8 import E4M3, E5M2, Fp8Handoff
from ..kernels.reference import ACTIVATION_FUNCTIONS
from .fp8_linear import Fp8Amaxes, check_fp8_recipe
from .block_weights import BlockWeights
from .recompute import recomputed_when_saved
from .linear import (ColumnParallelLinear, InitMethod, RowParallelLinear, column_input_part, column_parallel_input,
                     column_parallel_linears)

ACTIVATIONS = ACTIVATION_FUNCTIONS  # the non-gated MLP's: "gelu" (tanh, GPT-2's), "gelu_exact", "relu"
MLPS = tuple(ACTIVATIONS) + ("swiglu",)


def _on_the_same_kernels(activation):
    """`activation`, to be run again in the backward on the kernels (Triton or reference) it runs on now,
    whatever is forced there: the remade output must have the forward's bits."""
    backend = requested_backend()

    def remake() -> torch.Tensor:
        with use_backend(backend):
            return activation()
    return remake


class ParallelMLP(nn.Module):
    """down(act(up(x))), or with mlp="swiglu" down(silu(gate(x)) * up(x)) (Llama).

    x: [seq, batch, hidden] replicated over tp, or with sequence_parallel [seq/tp, batch, hidden];
    the output has x's layout. up/gate split ffn_hidden over tp (each rank computes
    ffn_hidden/tp features), down sums them back (all-reduce, or reduce-scatter under SP).
    Parameters: up_proj, gate_proj (swiglu only), down_proj, in nn.Linear layouts. Without a gate,
    up_proj's bias is added by the activation's kernel (tpflash.kernels.bias_activation) rather
    than in the GEMM, so that its gradient is summed in the same pass that writes dy.

    fused_dense=True (mlp="gelu" only) runs up -> GELU -> down through
    tpflash.kernels.fused_dense_gelu_dense (the cuBLASLt extension of csrc/ with its bias/GELU
    epilogues where it is built, the same composition otherwise), without overlap pipelining.
    Off by default: on an H100 it measured slower than the unfused GEMMs at every MLP shape of
    gpt-1.3b/2.7b, tp 1/2/4 (docs/performance.md, "Fused dense").
    fp8 "rowwise" / "tensorwise": the up/gate and down GEMMs in fp8 (tpflash.layers.fp8_linear, docs/fp8.md).
    recompute_activation: the activation's output, which the down projection's weight gradient reads, is
    not kept from the forward but remade in the backward from the up (and gate) outputs its own
    backward keeps (tpflash.layers.recompute): one elementwise pass for a [seq, b, ffn/tp] tensor
    less per layer (docs/performance.md, "Activation memory").
    `held_work` (None unless a block sets it): where the up/gate projection's weight gradient
    may be held back for a later layer's waits (tpflash.parallel.held_work). `block_weights`: its
    block's (tpflash.layers.block_weights), for the up/gate weights' casts.
    """

    def __init__(self, hidden: int, ffn_hidden: int, mlp: str = "gelu", bias: bool = True,
                 sequence_parallel: bool = False, process_group=None, *,
                 init_method: Optional[InitMethod] = None, out_init_method: Optional[InitMethod] = None,
                 fused_dense: bool = False, fp8: str = "off", recompute_activation: bool = False, device=None,
                 dtype=None):
        super().__init__()
        check_fp8_recipe(fp8)
        if fused_dense and fp8 != "off":
            raise ValueError(f"fused_dense=True runs its own bf16 GEMMs: it cannot be combined with fp8={fp8!r}")
        self.fp8 = fp8
        self.fp8_history = None  # fp8="delayed": the up(/gate) GEMM's amax histories (tpflash.layers.fp8_history)
        self.held_work: Optional[HeldWork] = None
        self.block_weights = BlockWeights()  # its block's, once in one
        if mlp not in MLPS:
            raise ValueError(f"mlp={mlp!r} must be one of {MLPS}")
        if fused_dense and mlp != "gelu":
            raise ValueError(f"fused_dense=True needs mlp='gelu' (cuBLASLt's tanh GELU epilogue), got mlp={mlp!r}")
        self.fused_dense = fused_dense
        self.recompute_activation = recompute_activation and not fused_dense  # the fused path keeps no h
        self.process_group = resolve_tp_group(process_group)
        tp = group_size(self.process_group)
        if ffn_hidden % tp:
            raise ValueError(f"ffn_hidden={ffn_hidden} is not divisible by tp={tp}")
        self.mlp, self.sequence_parallel = mlp, sequence_parallel
        kw = dict(process_group=sublayer_group(self.process_group), init_method=init_method, fp8=fp8, device=device,
                  dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, ffn_hidden, bias=bias, **kw)
        self.gate_proj = ColumnParallelLinear(hidden, ffn_hidden, bias=bias, **kw) if mlp == "swiglu" else None
        self.down_proj = RowParallelLinear(ffn_hidden, hidden, bias=bias, sequence_parallel=sequence_parallel,
                                           process_group=sublayer_group(self.process_group), init_method=out_init_method,
                                           fp8=fp8, device=device, dtype=dtype)

    def fp8_weight_groups(self) -> Optional[List[Tuple[torch.Tensor, ...]]]:
        """The weights each of its fp8 GEMMs casts with one tensorwise scale (up/gate stacked, down), or
        None on the fused-dense path (no fp8 GEMMs)."""
        if self.fused_dense:
            return None
        up = (self.up_proj.weight,) if self.gate_proj is None else (self.up_proj.weight, self.gate_proj.weight)
        return [up, (self.down_proj.weight,)]

    def weight_cast_groups(self) -> List[Tuple[Optional[torch.Tensor], ...]]:
        """The tensors forward casts to the compute dtype, grouped as it stacks them (weight_casts.prepare_cast):
        none on the fused-dense path, which casts its own; the activation kernel takes up_proj's bias as is."""
        if self.fused_dense or self.fp8 != "off":  # fp8: its GEMMs cast the weights themselves
            return []
        groups = [(self.down_proj.weight,), (self.down_proj.bias,)]
        if self.gate_proj is None:
            return groups + [(self.up_proj.weight,)]
        projections = (self.up_proj, self.gate_proj)
        return groups + [tuple(p.weight for p in projections), tuple(p.bias for p in projections)]

    def _fp8_handoffs(self) -> Tuple[Optional[Fp8Handoff], Optional[Fp8Handoff]]:
        """Delayed fp8, once its histories scale the casts, while training: (the up/gate GEMM's gradient,
        h), each written in fp8 by swiglu for the GEMM that multiplies it (kernels.fp8.Fp8Handoff),
        where the GEMMs take them (no up/gate biases; no padding features in down's input)."""
        gemms = (self.fp8_history, self.down_proj.fp8_history)
        if self.fp8 != "delayed" or not torch.is_grad_enabled() or any(h is None or not h.delayed for h in gemms):
            return None, None
        grad = Fp8Handoff(self.fp8_history.dy, E5M2) if self.up_proj.bias is None else None
        h = Fp8Handoff(self.down_proj.fp8_history.x, E4M3) if not self.down_proj.local_padding else None
        return grad, h

    def pairs_weight_grads(self) -> bool:
        """Whether the up and down projections' weight gradients have one shape ([ffn/tp, hidden] and
        [hidden, ffn/tp] with ffn/tp == hidden: a 4x MLP at tp=4), so that, both held for the output
        projection's waits, they run as one batched GEMM (tpflash.parallel.held_work). Not with a gate
        (the up/gate gradient is twice as tall), fp8 or the fused-dense path (their own GEMMs)."""
        return (self.gate_proj is None and self.fp8 == "off" and not self.fused_dense
                and self.up_proj.weight.shape == self.down_proj.weight.shape)

    def input_part(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """Where forward's x (shaped like `like`) may be written by its producer so that the up (and gate)
        projection's gather takes it without a copy (tpflash.layers.linear.column_input_part), or None."""
        if self.fused_dense:
            return None
        return column_input_part(like, self.up_proj.weight, self.process_group, self.sequence_parallel,
                                 self.up_proj.overlap, fp8=self.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_dense:
            x_full = column_parallel_input(x, self.process_group, self.sequence_parallel)  # [seq, b, hidden]
            rank_sum = fused_dense_gelu_dense(x_full, self.up_proj.weight, self.up_proj.bias,
                                              self.down_proj.weight, None)  # [seq, b, hidden], summed over tp below
            return self.down_proj.reduce_partial_sum(rank_sum)
        amaxes = None  # tensorwise fp8 with a gate: those of h and of [d_up | d_gate], below
        h_fp8 = None  # delayed fp8 with a gate: h in fp8 from swiglu, for the down GEMM
        if self.gate_proj is None:
            up_bias = self.up_proj.bias
            y = column_parallel_linears(x, [self.up_proj.weight], [None], self.process_group,
                                        self.sequence_parallel, self.up_proj.overlap, fp8=self.fp8,
                                        fp8_amaxes=Fp8Amaxes(history=self.fp8_history),
                                        held=self.held_work,
                                        casts=self.block_weights.casts)[0]  # [seq, b, ffn/tp], no bias yet
            # the bias added by the activation's kernel, whose backward sums its gradient while writing dy
            activation = partial(ACTIVATIONS[self.mlp], y) if up_bias is None else \
                partial(kernels.bias_activation, y, up_bias, self.mlp)
            h = activation()
        else:
            projections = [self.up_proj, self.gate_proj]
            # tensorwise fp8: swiglu takes the amaxes of h and of [d_up | d_gate] as it writes them, for
            # the casts of the GEMMs on either side (each a 0-d fp32, filled by swiglu's forward / backward)
            amaxes = [torch.empty((), device=x.device, dtype=torch.float32) for _ in range(2)] \
                if self.fp8 == "tensorwise" and torch.is_grad_enabled() else None
            grad_fp8, h_fp8 = self._fp8_handoffs()
            up, gate = column_parallel_linears(x, [p.weight for p in projections], [p.bias for p in projections],
                                               self.process_group, self.sequence_parallel, self.up_proj.overlap,
                                               fp8=self.fp8,
                                               fp8_amaxes=Fp8Amaxes(grad=amaxes[1] if amaxes else None,
                                                                    history=self.fp8_history,
                                                                    grad_fp8=grad_fp8),
                                               held=self.held_work,
                                               casts=self.block_weights.casts)  # [seq, b, ffn/tp] each
            # one pass each way; the backward writes [d_up | d_gate] as one buffer, the stacked GEMM's gradient
            activation = partial(kernels.swiglu, up, gate)
            h = kernels.swiglu(up, gate, amaxes, grad_fp8, h_fp8)  # with h_fp8: a stand-in carrying h's gradient
        remake = _on_the_same_kernels(activation) if self.recompute_activation and torch.is_grad_enabled() else None
        with recomputed_when_saved(h, remake):  # h not kept for the backward when remade there
            return self.down_proj(h, fp8_input_amax=amaxes[0] if amaxes else None,
                                  fp8_input=h_fp8)  # [seq(/tp), b, hidden]

    def extra_repr(self) -> str:
        return (f"mlp={self.mlp}, tp={group_size(self.process_group)}, sequence_parallel={self.sequence_parallel}"
                + (", fused_dense=True" if self.fused_dense else "")
                + (", recompute_activation=True" if self.recompute_activation else "")
                + (f", fp8={self.fp8}" if self.fp8 != "off" else ""))
