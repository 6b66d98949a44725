"""Column- and row-parallel linear layers (Megatron-style tensor parallelism).

ColumnParallelLinear splits the weight's output features over the tp group: each rank
computes out_features/tp columns of y = x W^T + b. RowParallelLinear splits the input
features: each rank computes a partial sum that is all-reduced (or reduce-scattered along
the sequence under sequence parallelism). A Column -> Row pair is a tensor-parallel MLP with
one collective in each direction.

Widths that do not divide by tp are padded the way the vocabulary is (sharding.ShardSpec): each
rank holds ceil(width/tp) features, the last rank(s) zero-padded. A padded ColumnParallelLinear's
padding outputs are zero and get no gradient (gather_output strips them); a padded
RowParallelLinear ignores its padding inputs (they are zeroed, whatever they hold), so
column -> any activation -> row computes exactly what the unpadded layers compute.

Sequence-parallel activations are sequence-first, [seq/tp, batch, hidden]: gathering dim 0
is one contiguous collective with no copy (the layers take `seq_dim` for other layouts).

Under sequence parallelism (seq_dim 0, tp > 1) the all-gather / reduce-scatter can overlap the
GEMMs, the other ranks' rows moved by the copy engines while this rank's are multiplied
(tpflash.parallel.overlap): with `overlap=True`, or with `overlap=None` (default) where overlap is
on (TPFLASH_OVERLAP=1, or by default in a CUDA graph capture whose GPUs map each other's memory:
decided once per capture and set on the captured layers). Results agree either way.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.fp8 import Fp8Handoff
from ..parallel import comm, overlap as _overlap
from ..parallel.held_work import HeldWork
from ..parallel.sharding import ShardSpec, take_shards
from ..parallel.state import group_rank, group_size, resolve_tp_group
from .autocast_linear import add_bias, linear, linears
from .block_weights import BlockWeights
from .weight_casts import PendingCast
from .fp8_linear import Fp8Amaxes, check_fp8_recipe, fp8_linears

InitMethod = Callable[[torch.Tensor], object]


def init_linear_full(out_features: int, in_features: int, bias: bool, init_method: Optional[InitMethod],
                     device=None, dtype=None):
    """The unsharded (weight, bias) exactly as nn.Linear(in, out) initialises them for the same RNG
    state (same draws in the same order), or with `init_method(weight)` and a zero bias."""
    weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
    b = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if init_method is None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if b is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            nn.init.uniform_(b, -bound, bound)
    else:
        init_method(weight)
        if b is not None:
            nn.init.zeros_(b)
    return weight, b


def _zero_padding(x: torch.Tensor, real: int) -> torch.Tensor:
    """x [*, n] with its last n - real features set to zero; their gradient is zero too (an activation
    f with f(0) != 0 leaves non-zero values in padding features, and a gradient there would move
    the padding weights off zero). Only for padded layers: a copy of x."""
    return F.pad(x.narrow(-1, 0, real), (0, x.shape[-1] - real))


def _local_real_and_padding(spec: ShardSpec, rank: int, tp: int) -> tuple:
    """(real, padding): how many of this rank's ceil(full/tp) features are real, and how many padding."""
    start, end = spec.local_range(rank, tp)
    return end - start, spec.chunk(tp) - (end - start)


def _overlapped(sequence_parallel: bool, seq_dim: int, group, overlap: Optional[bool]) -> bool:
    """Whether the overlapped path runs: SP along dim 0 over tp > 1, and overlap on (the layer's own
    flag, else TPFLASH_OVERLAP: tpflash.parallel.overlap.layer_overlaps)."""
    if not (sequence_parallel and seq_dim == 0 and group_size(group) > 1):
        return False
    return _overlap.layer_overlaps(overlap)


def _pipelined(layer: nn.Module) -> bool:
    """Whether a Column/RowParallelLinear takes the overlapped path now."""
    return _overlapped(layer.sequence_parallel, layer.seq_dim, layer.process_group, layer.overlap)


def column_parallel_linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
                            biases: Sequence[Optional[torch.Tensor]], group, sequence_parallel: bool,
                            overlap: Optional[bool] = None, seq_dim: int = 0,
                            save_gathered_input: Optional[bool] = None, fp8: str = "off",
                            fp8_amaxes: Optional[Fp8Amaxes] = None, held: Optional[HeldWork] = None,
                            casts: Optional[PendingCast] = None) -> List[torch.Tensor]:
    """[F.linear(x_full, W_i, b_i)] for column-parallel weights W_i [out_i/tp, in] sharing one input.

    One input collective serves them all (q/k/v, up/gate): under SP x [seq/tp, b, in] is
    all-gathered along `seq_dim` (overlapped with the GEMMs when overlap is on: `_overlapped`,
    tpflash.parallel.overlap) and its gradient reduce-scattered; otherwise x is replicated and
    its gradient all-reduced. Returns [seq, b, out_i/tp] per weight. Process group: `group`.
    fp8 "rowwise" / "tensorwise": the GEMMs in fp8 (tpflash.layers.fp8_linear); under SP the input is
    cast first and gathered in fp8 (no overlap pipelining). fp8_amaxes: x's amax (this rank's part)
    and the stacked outputs' gradient's, from the neighbouring kernels (Fp8Amaxes). held: on the
    overlapped path, where the weight gradient may be held back for a later layer's waits
    (tpflash.parallel.held_work). x may also come as (x, *ports) from a norm with `grad_ports`
    (kernels.layer_norm): the overlapped path hands the ports its input gradient's received parts;
    elsewhere the ports are left without a gradient, which adds nothing. casts: a block's weight casts
    for this forward (tpflash.layers.block_weights), where the GEMMs find the weights cast.
    """
    x, grad_ports = (x[0], tuple(x[1:])) if isinstance(x, tuple) else (x, ())
    if fp8 != "off" and sequence_parallel and group_size(group) > 1:
        return fp8_linears(x, weights, biases, fp8, group, seq_dim, fp8_amaxes)
    if fp8 == "off" and _overlapped(sequence_parallel, seq_dim, group, overlap):
        return _overlap.all_gather_linear(x, weights, biases, group, save_gathered_input, held, grad_ports, casts)
    x = column_parallel_input(x, group, sequence_parallel, seq_dim)  # [seq, *, in]
    return linears(x, weights, biases, fp8, fp8_amaxes, casts)  # one GEMM over the stacked weights


def column_input_part(like: torch.Tensor, first_weight: torch.Tensor, group, sequence_parallel: bool,
                      overlap: Optional[bool] = None, seq_dim: int = 0,
                      save_gathered_input: Optional[bool] = None, fp8: str = "off") -> Optional[torch.Tensor]:
    """Where `column_parallel_linears(x, [first_weight, ...], ...)` with the same arguments finds this rank's
    x without copying it, for an x shaped like `like`: a tensor that x's producer writes x into (the
    norm before the layer: ParallelNorm's `out`), or None where the call copies x wherever it lies
    (every path but the overlapped one keeping its input inside a CUDA graph capture:
    tpflash.parallel.overlap.gathered_input_part). Process group: `group`."""
    if fp8 != "off" or not _overlapped(sequence_parallel, seq_dim, group, overlap):
        return None
    return _overlap.gathered_input_part(like, first_weight, group, save_gathered_input)


def column_parallel_input(x: torch.Tensor, group, sequence_parallel: bool, seq_dim: int = 0) -> torch.Tensor:
    """The full input of column-parallel GEMMs: under SP x [seq/tp, *, in] all-gathered along `seq_dim`
    (gradient reduce-scattered), else x itself (replicated; gradient all-reduced over `group`).
    Under autocast x is cast to the autocast dtype first: F.linear would cast the gathered tensor
    anyway (same bits), and an fp32 residual stream would otherwise travel, and have its gradient
    reduced, at twice the bytes."""
    if group_size(group) > 1:
        x = x.to(_overlap.linear_compute_dtype(x))
    if sequence_parallel:
        return comm.all_gather_along_seq(x, group, seq_dim)
    return comm.copy_to_tp_region(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] split by rows (output features) over tp.

    Input: [*, in_features], replicated over tp; or, with sequence_parallel, [seq/tp, *, in]
    sharded along `seq_dim` (all-gathered here). Output: [*, ceil(out_features/tp)] on each rank
    (zero padding features at the end of the last rank(s) when tp does not divide out_features), or
    [*, out_features] with gather_output. Process group: `process_group`, else the default
    state's tp group, else none (tp=1, a plain nn.Linear). overlap: True/False, or None (default)
    for TPFLASH_OVERLAP's setting, or a CUDA graph capture's decision (module docstring).
    save_gathered_input (overlapped path only): keep the all-gathered input for the backward (True),
    or gather it again there (False, 1/tp of the memory); None (default): kept
    (tpflash.parallel.overlap.keeps_gathered_input). fp8: "off", or "rowwise" / "tensorwise" for
    fp8 GEMMs (tpflash.layers.fp8_linear; no overlap pipelining).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, process_group=None, *, init_method: Optional[InitMethod] = None,
                 seq_dim: int = 0, overlap: Optional[bool] = None, save_gathered_input: Optional[bool] = None,
                 fp8: str = "off", device=None, dtype=None):
        super().__init__()
        check_fp8_recipe(fp8)
        self.fp8 = fp8
        self.fp8_history = None  # fp8="delayed": this GEMM's amax histories (tpflash.layers.fp8_history)
        self.process_group = resolve_tp_group(process_group)
        tp, rank = group_size(self.process_group), group_rank(self.process_group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.seq_dim = gather_output, sequence_parallel, seq_dim
        self.overlap, self.save_gathered_input = overlap, save_gathered_input
        self.tp_shard_specs = {"weight": ShardSpec(0, out_features)}
        self.padded = out_features % tp != 0  # same on every rank
        # output features of this rank: the real ones, then zero padding (only on the last rank(s))
        self.local_real, self.local_padding = _local_real_and_padding(self.tp_shard_specs["weight"], rank, tp)
        weight, b = init_linear_full(out_features, in_features, bias, init_method, device, dtype)
        self.weight = nn.Parameter(self.tp_shard_specs["weight"].shard(weight, rank, tp))
        if bias:
            self.tp_shard_specs["bias"] = ShardSpec(0, out_features)
            self.bias = nn.Parameter(self.tp_shard_specs["bias"].shard(b, rank, tp))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "ColumnParallelLinear":
        """The column-parallel form of an existing nn.Linear: this rank keeps its (padded) shard of
        linear's weight and bias, with no new initialisation. kwargs: the constructor's options
        (gather_output, sequence_parallel, process_group, seq_dim, overlap, save_gathered_input)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                    dtype=linear.weight.dtype, **kwargs)
        take_shards(layer, {"weight": linear.weight, "bias": linear.bias})
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, = column_parallel_linears(x, [self.weight], [self.bias], self.process_group, self.sequence_parallel,
                                     self.overlap, self.seq_dim, self.save_gathered_input, self.fp8,
                                     Fp8Amaxes(history=self.fp8_history))  # [*, out/tp]
        if self.gather_output:
            y = comm.gather_along_dim(y, -1, self.process_group)
            if self.padded:  # the padding is at the end of the gathered features; its gradient is zero
                y = y.narrow(-1, 0, self.out_features)
        elif self.local_padding:
            y = _zero_padding(y, self.local_real)  # values already zero: this drops their gradient
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={group_size(self.process_group)}, "
                f"sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
                + (f", fp8={self.fp8}" if self.fp8 != "off" else ""))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W [out_features, in_features] split by columns (input features) over tp.

    Input: [*, ceil(in_features/tp)] (input_is_parallel, e.g. a ColumnParallelLinear's output; the
    features past the rank's real ones are padding and ignored) or [*, in_features] replicated
    (padded to a multiple of tp and split here). Output: [*, out_features] summed over tp, or, with
    sequence_parallel, reduce-scattered along `seq_dim` to [seq/tp, *, out_features].
    The bias is replicated and added after the reduction (at tp=1, inside the GEMM). fp8: as
    ColumnParallelLinear's. `held_work` (None unless a block sets it): work held back for this
    layer's waits, run on its overlapped path (tpflash.parallel.held_work). `weight_grad_held_for`
    (None unless a block sets it: the MLP's down projection where its weight gradient has the up
    projection's shape): where its overlapped backward may hold its weight-gradient GEMM, to be
    batched with the up projection's (tpflash.parallel.held_work). `output_parts` (False
    unless a block sets it, where a norm adds the output to the residual stream next): on the
    overlapped path inside a CUDA graph capture, the output comes as a tuple of parts whose sum it
    is (tpflash.parallel.overlap.linear_reduce_scatter), which kernels.layer_norm / rms_norm add
    in their own pass: the sum's own read and write are saved. `block_weights`: its block's
    (tpflash.layers.block_weights; an empty one of its own outside a block): the weight's cast and
    the bias's tp-gradient alias during the block's forward.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, process_group=None, *, init_method: Optional[InitMethod] = None,
                 seq_dim: int = 0, overlap: Optional[bool] = None, fp8: str = "off", device=None, dtype=None):
        super().__init__()
        check_fp8_recipe(fp8)
        self.fp8 = fp8
        self.fp8_history = None  # fp8="delayed": this GEMM's amax histories (tpflash.layers.fp8_history)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (the input must already be "
                             "split over features)")
        self.process_group = resolve_tp_group(process_group)
        tp, rank = group_size(self.process_group), group_rank(self.process_group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = input_is_parallel, sequence_parallel, seq_dim
        self.overlap = overlap
        self.held_work: Optional[HeldWork] = None  # a block's: run on the overlapped path
        self.weight_grad_held_for: Optional[HeldWork] = None  # a block's: where the weight gradient may wait
        self.output_parts = False  # a block's: the reduce-scatter's parts left to the next norm to add
        self.block_weights = BlockWeights()  # its block's, once in one
        self.tp_shard_specs = {"weight": ShardSpec(1, in_features)}
        spec = self.tp_shard_specs["weight"]
        self.padded_in_features = spec.chunk(tp) * tp  # in_features, or the next multiple of tp
        self.local_real, self.local_padding = _local_real_and_padding(spec, rank, tp)  # input features here
        weight, b = init_linear_full(out_features, in_features, bias, init_method, device, dtype)
        self.weight = nn.Parameter(spec.shard(weight, rank, tp))
        self.bias = nn.Parameter(b) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "RowParallelLinear":
        """The row-parallel form of an existing nn.Linear: this rank keeps its (padded) shard of
        linear's weight and the whole bias, with no new initialisation. kwargs: the constructor's
        options (input_is_parallel, sequence_parallel, process_group, seq_dim, overlap)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                    dtype=linear.weight.dtype, **kwargs)
        take_shards(layer, {"weight": linear.weight, "bias": linear.bias})
        return layer

    def forward(self, x: torch.Tensor, fp8_input_amax: Optional[torch.Tensor] = None,
                fp8_input: Optional[Fp8Handoff] = None) -> torch.Tensor:
        """x [*, in/tp] (input_is_parallel) or [*, in] -> [*, out] (module docstring). fp8_input_amax:
        x's amax (0-d fp32) from its producer, for tensorwise fp8; used where x reaches the GEMM as
        given (not split or padded here). fp8_input (delayed fp8, input_is_parallel, no padding): x
        already cast by its producer (kernels.fp8.Fp8Handoff), whose values are then not read."""
        if fp8_input is not None and (not self.input_is_parallel or self.local_padding):
            raise ValueError("RowParallelLinear: fp8_input needs input_is_parallel=True and no padding features")
        amaxes = Fp8Amaxes(fp8_input_amax if self.input_is_parallel and not self.local_padding else None,
                           history=self.fp8_history, input_fp8=fp8_input)
        if not self.input_is_parallel:
            if self.padded_in_features != self.in_features:  # [*, in] -> [*, padded]: zero padding features
                x = F.pad(x, (0, self.padded_in_features - self.in_features))
            x = comm.split_along_dim(x, -1, self.process_group)
        elif self.local_padding:
            x = _zero_padding(x, self.local_real)  # e.g. act(0) != 0 from a padded column layer
        casts = self.block_weights.casts
        if self.fp8 == "off" and _pipelined(self):  # each peer's rows computed and sent while the next are computed
            return _overlap.linear_reduce_scatter(x, self.weight, self.process_group, self._bias_summed_over_tp(),
                                                  self.held_work, self.output_parts, casts,
                                                  self.weight_grad_held_for)
        if group_size(self.process_group) == 1:  # nothing to reduce: the bias rides in the GEMM's epilogue
            return linear(x, self.weight, self.bias, self.fp8, amaxes, casts)
        return self.reduce_partial_sum(linear(x, self.weight, fp8=self.fp8, fp8_amaxes=amaxes, casts=casts))

    def reduce_partial_sum(self, y: torch.Tensor) -> torch.Tensor:
        """This layer's output from the rank's partial product y = x_local W_local^T [*, out]: summed over
        tp (reduce-scattered along the sequence under SP), plus the bias. For callers that compute
        the GEMM themselves (ParallelMLP's fused dense path)."""
        if self.sequence_parallel:
            y = comm.reduce_scatter_along_seq(y, self.process_group, self.seq_dim)
        else:
            y = comm.reduce_from_tp_region(y, self.process_group)
        return self.add_bias(y)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """y + bias for the reduced output y, in y's dtype (an fp32 bias does not promote a bf16 output
        under autocast); under SP the bias gradient is summed over tp."""
        return add_bias(y, self._bias_summed_over_tp(), self.block_weights.casts)

    def tp_partial_grad_parameters(self) -> List[nn.Parameter]:
        """The parameters whose gradient each tp rank holds only a part of: under SP, the bias."""
        return [self.bias] if self.bias is not None and self.sequence_parallel else []

    def _bias_summed_over_tp(self) -> Optional[torch.Tensor]:
        """The bias, its gradient summed over tp under SP (each rank's tokens give a part of it)."""
        if self.bias is not None and self.sequence_parallel:
            return self.block_weights.summed_over_tp([self.bias], self.process_group)[0]
        return self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={group_size(self.process_group)}, "
                f"sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
                + (f", fp8={self.fp8}" if self.fp8 != "off" else ""))
