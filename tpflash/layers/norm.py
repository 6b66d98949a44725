"""LayerNorm / RMSNorm over the hidden dim, with an optional fused residual add, for tp and SP.

Norm weights are replicated over tp. Without sequence parallelism every tp rank normalises the
same (replicated) activations, so every rank computes the same weight gradient and nothing needs
reducing. Under sequence parallelism each rank normalises its own tokens, so each holds a
*partial* weight gradient: the weight goes through `copy_to_tp_region` (identity forward,
all-reduce backward), which sums the partials, the same way RowParallelLinear treats its bias;
inside a block, through the alias its block makes for it (tpflash.layers.block_weights), whose
gradient one all-reduce sums with the block's others.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .. import kernels
from ..parallel.state import group_size, resolve_tp_group
from .block_weights import BlockWeights

NORMS = ("layernorm", "rmsnorm")


class ParallelNorm(nn.Module):
    """y = norm(x) * weight (+ bias) over the last dim; `kind` is "layernorm" or "rmsnorm".

    forward(x) -> y, or forward(x, residual) -> (norm(x + residual), x + residual): the
    pre-norm residual add fused into the norm kernel. x: [*, dim] (under SP: [seq/tp, batch, dim]),
    or a tuple of parts whose sum it is (a row layer's `output_parts`), added by the same kernel.
    State-dict keys equal nn.LayerNorm's ("weight", "bias") / an RMSNorm's ("weight").
    autocast_output: under autocast, y comes out in the autocast dtype, rounded once from fp32, which
    is what the next linear layer would cast it to; that saves the cast's pass and its gradient's
    (the transformer blocks set it; default off: nn.LayerNorm's fp32 output under autocast).
    Process group: `process_group`, else the default tp group, else none; only used under SP.
    `grad_ports` (0 by default; a block sets it for a CUDA graph capture: take_input_grad_parts): y
    comes as a tuple (y, *ports) whose ports' gradients the backward adds to y's (kernels.layer_norm),
    for a column layer that hands back its input gradient as a reduce-scatter's parts, unsummed.
    `x_grad_into` (None by default; a block sets it for a CUDA graph capture: norms_write_row_grads):
    with a residual, where the backward writes x's gradient (kernels.layer_norm's x_grad_into), for a
    row layer before the norm whose backward all-gathers that gradient from there.
    """

    def __init__(self, dim: int, kind: str = "layernorm", eps: float = 1e-5, bias: bool = True,
                 sequence_parallel: bool = False, process_group=None, autocast_output: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"norm={kind!r} must be one of {NORMS}")
        if kind == "rmsnorm" and bias:
            raise ValueError("norm='rmsnorm' has no bias; pass bias=False")
        self.dim, self.kind, self.eps, self.sequence_parallel = dim, kind, eps, sequence_parallel
        self.autocast_output = autocast_output
        self.process_group = resolve_tp_group(process_group)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None
        self.grad_ports = 0
        self.x_grad_into = None
        self.block_weights = BlockWeights()  # its block's, once in one

    def _params(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight, bias) as the kernel uses them: under SP with their per-token-shard gradients summed
        over tp (BlockWeights.summed_over_tp: the block's aliases, else one all-reduce for both)."""
        if not self.sequence_parallel:
            return self.weight, self.bias
        weight, bias = self.block_weights.summed_over_tp([self.weight, self.bias], self.process_group)
        return weight, bias

    def tp_partial_grad_parameters(self) -> List[nn.Parameter]:
        """The parameters whose gradient each tp rank holds only a part of: under SP, weight and bias."""
        return [p for p in (self.weight, self.bias) if p is not None] if self.sequence_parallel else []

    def forward(self, x: Union[torch.Tensor, Sequence[torch.Tensor]], residual: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """out: where y is written (kernels.layer_norm's `out`), e.g. the next column layer's `input_part`."""
        weight, bias = self._params()
        first = x[0] if isinstance(x, (tuple, list)) else x
        out_dtype = None
        if self.autocast_output and first.is_floating_point() and torch.is_autocast_enabled(first.device.type):
            out_dtype = torch.get_autocast_dtype(first.device.type)
        if self.kind == "layernorm":
            return kernels.layer_norm(x, weight, bias, self.eps, residual, out_dtype, out, self.grad_ports,
                                      self.x_grad_into)
        return kernels.rms_norm(x, weight, self.eps, residual, out_dtype, out, self.grad_ports, self.x_grad_into)

    def extra_repr(self) -> str:
        return (f"{self.dim}, kind={self.kind}, eps={self.eps}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, tp={group_size(self.process_group)}")


class HeadNorm(nn.Module):
    """Per-head RMSNorm (Qwen3's q_norm / k_norm): y = x * rsqrt(mean(x^2) + eps) * weight over the last
    dim of x [..., heads, head_dim], fp32 statistics, x's dtype out. State-dict key "weight" [head_dim].

    The weight is replicated over tp but every rank normalises only its own heads, so each rank's
    weight gradient is partial whatever the sequence layout: the weight goes through
    copy_to_tp_region, which sums the gradient over tp (as KVLinear's replicated weights do).
    Process group: `process_group`, else the default tp group, else none.
    """

    def __init__(self, head_dim: int, eps: float = 1e-6, process_group=None, device=None, dtype=None):
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        self.process_group = resolve_tp_group(process_group)
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
        self.block_weights = BlockWeights()  # its block's, once in one

    def tp_partial_grad_parameters(self) -> List[nn.Parameter]:
        """The weight, whenever tp > 1 (each rank's gradient covers only its heads)."""
        return [self.weight] if group_size(self.process_group) > 1 else []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, = self.block_weights.summed_over_tp([self.weight], self.process_group)
        return kernels.rms_norm(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.head_dim}, eps={self.eps}, tp={group_size(self.process_group)}"
