"""Pre-norm transformer block over tp, in sequence-parallel form when asked.

    stream = x + residual                     (the residual add is deferred into the next norm)
    h, stream = attn_norm(x, residual)        fused add + norm
    a = dropout(attn(h))
    h, stream = mlp_norm(a, stream)           fused add + norm
    return dropout(mlp(h)), stream            the caller's next norm adds them

With sequence_parallel, x, residual and both outputs are [seq/tp, batch, hidden]: attention and
the MLP all-gather their input once before their column GEMMs and reduce-scatter after their row
GEMM; the norms, dropouts and residual adds run on 1/tp of the tokens. Without it they are
[seq, batch, hidden], replicated over tp.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ..kernels.norm import MAX_PARTS
from ..parallel.comm import tp_grad_aliases
from ..parallel.held_work import HeldWork
from ..parallel.overlap_transfers import row_grad_part
from ..parallel.random import RNGTracker
from ..parallel.state import group_rank, group_size, resolve_tp_group, sublayer_group
from .attention import ParallelAttention
from .block_weights import BlockWeights
from .fp8_linear import TENSOR_SCALED
from .linear import InitMethod
from .mlp import ParallelMLP
from .norm import ParallelNorm
from .weight_casts import cast_now, compute_dtype

CHECKPOINTING = (None, "activation", "full", "mlp", "selective")

# "selective" keeps these ops' outputs (the GEMMs and PyTorch's fused attention) and recomputes the rest
# of the block (norms, activations, rotary, casts) in its backward: the GEMMs are most of a block's
# compute and a fraction of its saved activations
_KEPT_BY_SELECTIVE = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(torch.ops.aten, name))


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(_selective_policy)


class ParallelTransformerBlock(nn.Module):
    """One GPT/Llama block: ParallelAttention and ParallelMLP, each behind a (fused-residual) norm.

    forward(x, residual=None) -> (out, residual): the residual stream after the block is
    out + residual (residual=None on the first block means x is the whole stream); finish the
    last block with `final_norm(out, residual)`. Layout: [seq, batch, hidden], or
    [seq/tp, batch, hidden] with sequence_parallel. x may be a tuple of parts whose sum it is (a
    previous block's `out` under `hand_output_parts`), which attn_norm adds.
    checkpoint: None, "activation" (remake the MLP activation's output in the backward, one elementwise
    pass, instead of keeping it: ParallelMLP's recompute_activation), "full" (recompute the whole block
    in backward), "mlp" (recompute the MLP only, whose [seq, batch, ffn/tp] activations are the block's
    largest) or "selective" (keep the GEMMs' and fused attention's outputs, recompute the rest: norms,
    activations, rotary; dropout 0). `held_work`: work held for the output projection's waits
    where a CUDA graph capture hands it over (GraphedBlocks; tpflash.parallel.held_work): the next
    block's weight casts in the forward, the MLP's up-projection weight-gradient GEMM in the backward
    (with the down projection's, batched, where the two have one shape: ParallelMLP.pairs_weight_grads).
    `block_weights` (tpflash.layers.block_weights): what its layers take in place of their parameters
    in a forward, the weights cast once and one alias per partial-gradient parameter; forward fills
    it, unless GraphedBlocks has for its capture.
    Attention options (head_dim, qkv_bias, qk_norm, rope_scaling, max_positions, and context parallelism's
    cp_group and cp_comm) are ParallelAttention's; fp8 (the projections' GEMMs) goes to attention and MLP;
    forward's keyword arguments (position_ids, cu_seqlens, max_seqlen: packed documents) go to it.
    Dropout (residual branches) draws from `rng_tracker`: the "sharded" stream under SP, the
    "replicated" one otherwise (tpflash.parallel.random). Parameters: attn_norm, attn, mlp_norm, mlp.
    """

    def __init__(self, hidden: int, n_head: int, n_kv_head: Optional[int] = None, ffn_hidden: Optional[int] = None,
                 mlp: str = "gelu", norm: str = "layernorm", position: str = "learned", bias: bool = True,
                 norm_eps: float = 1e-5, rope_theta: float = 10000.0, dropout: float = 0.0,
                 sequence_parallel: bool = False, process_group=None, *, checkpoint: Optional[str] = None,
                 rng_tracker: Optional[RNGTracker] = None, init_method: Optional[InitMethod] = None,
                 out_init_method: Optional[InitMethod] = None, head_dim: Optional[int] = None,
                 qkv_bias: Optional[bool] = None, qk_norm: bool = False, rope_scaling: Optional[Dict[str, Any]] = None,
                 max_positions: int = 2048, cp_group=None, cp_comm: str = "ring", fp8: str = "off", device=None,
                 dtype=None):
        super().__init__()
        if checkpoint not in CHECKPOINTING:
            raise ValueError(f"checkpoint={checkpoint!r} must be one of {CHECKPOINTING}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout} must be in [0, 1)")
        if checkpoint == "selective" and dropout:
            raise ValueError(f"checkpoint='selective' needs dropout=0, got dropout={dropout}: its recomputation "
                             "would draw other masks (use 'full', which replays the random streams)")
        self.process_group = resolve_tp_group(process_group)
        self.sequence_parallel, self.dropout, self.checkpoint, self.fp8 = sequence_parallel, dropout, checkpoint, fp8
        self.rng_tracker = rng_tracker or RNGTracker(tp_rank=group_rank(self.process_group))
        ffn_hidden = ffn_hidden or 4 * hidden
        norm_kw = dict(kind=norm, eps=norm_eps, bias=bias and norm == "layernorm", sequence_parallel=sequence_parallel,
                       process_group=sublayer_group(self.process_group), autocast_output=True, device=device, dtype=dtype)
        layer_kw = dict(bias=bias, sequence_parallel=sequence_parallel, process_group=sublayer_group(self.process_group),
                        init_method=init_method, out_init_method=out_init_method, fp8=fp8, device=device, dtype=dtype)
        self.attn_norm = ParallelNorm(hidden, **norm_kw)
        self.attn = ParallelAttention(hidden, n_head, n_kv_head, position=position, rope_theta=rope_theta,
                                      head_dim=head_dim, qkv_bias=qkv_bias, qk_norm=qk_norm, norm_eps=norm_eps,
                                      rope_scaling=rope_scaling, max_positions=max_positions, cp_group=cp_group,
                                      cp_comm=cp_comm, **layer_kw)
        self.mlp_norm = ParallelNorm(hidden, **norm_kw)
        self.mlp = ParallelMLP(hidden, ffn_hidden, mlp=mlp, recompute_activation=checkpoint == "activation", **layer_kw)
        # what the layers take in place of their parameters in a forward: one cast of the weights, one
        # all-reduce for the partial gradients (tpflash.layers.block_weights)
        self.block_weights = BlockWeights()
        for layer in self.modules():
            if isinstance(getattr(layer, "block_weights", None), BlockWeights):
                layer.block_weights = self.block_weights
        # work the output projection runs while its transfers travel (tpflash.parallel.held_work)
        self.held_work = HeldWork()
        self.mlp.held_work = self.attn.o_proj.held_work = self.held_work
        if self.mlp.pairs_weight_grads():  # the down projection's weight gradient waits to be batched with the up's
            self.mlp.down_proj.weight_grad_held_for = self.held_work
        # the output projection's reduce-scatter summed by mlp_norm's kernel, where nothing else reads
        # its output: no dropout on it, and no recomputation of it that would need the sum
        self.norm_sums_parts = not dropout and checkpoint in (None, "activation")
        self.attn.o_proj.output_parts = self.norm_sums_parts
        # the norms write their outputs where the next layer's gather keeps its input (inside a CUDA graph
        # capture, overlapped), sparing the gather its copy of this rank's rows; where nothing of the
        # forward is recomputed before the backward reads those buffers
        self.norms_write_in_place = checkpoint in (None, "activation")
        # the next block's attn_norm may write this block's output gradient where the down projection's
        # backward gathers it (norms_write_row_grads): nothing recomputed in between, no fp8 layer casting
        # the gradient first, a down projection that gathers it
        self.output_grad_gathered_in_place = (checkpoint in (None, "activation") and fp8 == "off"
                                              and not self.mlp.fused_dense)

    def hand_output_parts(self, enabled: bool) -> None:
        """Whether forward may return `out` as a tuple of parts whose sum it is (the MLP's reduce-scatter
        left unsummed on the overlapped path inside a CUDA graph capture), for a caller whose next
        norm adds them at once (the next block's attn_norm, where that block recomputes nothing of its
        forward: its `norm_sums_parts`); only where this block leaves its own output projection's
        parts to its norm (no dropout, no recomputation). GraphedBlocks sets it for its capture."""
        self.mlp.down_proj.output_parts = enabled and self.norm_sums_parts

    def take_input_grad_parts(self, enabled: bool) -> None:
        """Whether the norms' outputs come with gradient ports (ParallelNorm's `grad_ports`: tp - 1) through
        which the q/k/v and up projections hand back their input gradient as the reduce-scatter's
        parts, unsummed, where the norms' backward kernels add them (inside a CUDA graph capture,
        overlapped). Only where nothing of the forward is recomputed and the projections multiply in
        the compute dtype, at 2 to 4 ranks (the kernel adds up to four parts). GraphedBlocks sets it
        for its capture."""
        ports = group_size(self.process_group) - 1
        able = (enabled and 1 <= ports < MAX_PARTS and self.checkpoint in (None, "activation")
                and self.fp8 == "off")
        self.attn_norm.grad_ports = ports if able else 0
        self.mlp_norm.grad_ports = ports if able and not self.mlp.fused_dense else 0

    def norms_write_row_grads(self, enabled: bool, previous: Optional["ParallelTransformerBlock"] = None,
                              holding: bool = False) -> None:
        """Whether the norms write the gradient of their input, a row layer's output, where that layer's
        backward all-gathers it (ParallelNorm.x_grad_into: overlap_transfers.row_grad_part, inside a CUDA
        graph capture over the copy engines), sparing the gather its copy of this rank's rows: mlp_norm
        for the output projection and, where this block's input is the output of the block `previous`,
        attn_norm for that block's down projection (`previous.output_grad_into(holding)`; `holding`:
        whether the capture holds weight gradients, tpflash.parallel.held_work). Only under sequence
        parallelism (where a row layer's backward starts with that gather), where nothing is recomputed
        between the two backwards and no fp8 layer casts the gradient first. GraphedBlocks sets it for
        its capture."""
        able = (enabled and self.sequence_parallel and group_size(self.process_group) > 1
                and self.checkpoint in (None, "activation") and self.fp8 == "off")
        group = sublayer_group(self.process_group)
        self.mlp_norm.x_grad_into = functools.partial(row_grad_part, group) if able else None
        self.attn_norm.x_grad_into = previous.output_grad_into(holding) if able and previous is not None else None

    def output_grad_into(self, holding: bool = False):
        """Where the norm after this block may write this block's output gradient (a norm's x_grad_into):
        where the down projection's backward gathers it (overlap_transfers.row_grad_part: the buffer where,
        weight gradients being held (`holding`), it keeps grad_y for its own), or None where this block's
        `output_grad_gathered_in_place` is False."""
        if not self.output_grad_gathered_in_place:
            return None
        kept = holding and self.mlp.down_proj.weight_grad_held_for is not None
        return functools.partial(row_grad_part, sublayer_group(self.process_group), kept=kept)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return self.rng_tracker.dropout(x, self.dropout, sharded=self.sequence_parallel, training=self.training)

    def _run_mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.checkpoint == "mlp" and torch.is_grad_enabled():
            # the MLP draws no random numbers: no RNG state to save (nor to read while CUDA graphs capture)
            return torch_checkpoint(self.mlp, h, use_reentrant=False, preserve_rng_state=False)
        return self.mlp(h)

    def tp_partial_grad_parameters(self) -> List[nn.Parameter]:
        """The parameters whose gradient each tp rank holds only a part of (under SP the norms' weights
        and biases and the row layers' biases; replicated k/v projections): the block sums all of
        them over tp in one all-reduce at the end of its backward (comm.tp_grad_aliases)."""
        if group_size(self.process_group) == 1:  # nothing is partial; and eager forwards ask every step
            return []
        return [p for m in self.modules() if m is not self and hasattr(m, "tp_partial_grad_parameters")
                for p in m.tp_partial_grad_parameters()]

    def backward_reads_weights(self) -> bool:
        """Whether this block's backward reads its projections' weights (sharded data parallelism gathers
        them again for it, tpflash.parallel.zero3): not where every projection multiplies in fp8
        tensorwise or delayed, whose backward uses the fp8 weights its forward saved, and no checkpointing
        reruns a GEMM (None, or "activation", which remakes the MLP activation from the GEMMs' saved outputs)."""
        return not (self.fp8 in TENSOR_SCALED and self.checkpoint in (None, "activation"))

    def fp8_weight_groups(self) -> Optional[List[Tuple[torch.Tensor, ...]]]:
        """Under fp8 tensorwise, the weights each projection GEMM casts with one scale (q/k/v, o, up/gate,
        down): what a holder of the weights may hand the GEMMs pre-cast (kernels.fp8.Fp8Weight; fsdp=zero3
        gathers them in fp8). None for other recipes (delayed scales its weights by their histories), or
        where a GEMM does not multiply whole weights."""
        if self.fp8 != "tensorwise":
            return None
        attn, mlp = self.attn.fp8_weight_groups(), self.mlp.fp8_weight_groups()
        return None if attn is None or mlp is None else attn + mlp

    def fp8_gemm_layers(self) -> List[nn.Module]:
        """Under fp8="delayed", the layers that own its fp8 GEMMs (q/k/v: the attention, o, up/gate: the
        MLP, down), each holding that GEMM's amax histories as `fp8_history` once its model made them
        (tpflash.layers.fp8_history.AmaxHistory); [] for other recipes."""
        if self.fp8 != "delayed":
            return []
        return [self.attn, self.attn.o_proj, self.mlp, self.mlp.down_proj]

    def weight_cast_groups(self) -> List[Tuple[Optional[torch.Tensor], ...]]:
        """The tensors the block's forward casts to the compute dtype, grouped as its layers stack them."""
        return self.attn.weight_cast_groups() + self.mlp.weight_cast_groups()

    def _forward(self, x: torch.Tensor, residual: Optional[torch.Tensor],
                 **attn_kw) -> Tuple[torch.Tensor, torch.Tensor]:
        # One all-reduce for the block's partial gradients instead of one per norm and row bias (at tp=2
        # each cost ~30 us of a serial chain), and one multi-tensor cast of its weights instead of ~10
        # cast kernels (docs/architecture.md, "Layers and data flow"), unless GraphedBlocks gave them.
        first = x[0] if isinstance(x, tuple) else x  # x may be parts (hand_output_parts)
        given = self.block_weights
        casts = None if given.casts is not None else cast_now(self.weight_cast_groups(), compute_dtype(first))
        aliases = None if given.aliases is not None else tp_grad_aliases(self.tp_partial_grad_parameters(),
                                                                           self.process_group)
        with given.use(casts, aliases):
            into = self.attn.input_part(first) if self.norms_write_in_place else None
            if residual is None:
                h, residual = self.attn_norm(x, out=into), x
            else:
                h, residual = self.attn_norm(x, residual=residual, out=into)
            a = self._dropout(self.attn(h, **attn_kw))
            into = self.mlp.input_part(a[0] if isinstance(a, tuple) else a) if self.norms_write_in_place else None
            h, residual = self.mlp_norm(a, residual=residual, out=into)
            return self._dropout(self._run_mlp(h)), residual

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
                position_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, tuple) and residual is None:
            raise ValueError(f"x is a tuple of {len(x)} parts but residual is None: parts (a previous block's "
                             "out under hand_output_parts) come with that block's residual")
        attn_kw = {}
        if position_ids is not None or cu_seqlens is not None:  # packed documents (ParallelAttention.forward)
            attn_kw = dict(position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if self.checkpoint == "selective" and torch.is_grad_enabled():
            return torch_checkpoint(self._forward, x, residual, use_reentrant=False, preserve_rng_state=False,
                                    context_fn=_selective_contexts, **attn_kw)
        if self.checkpoint == "full" and torch.is_grad_enabled():
            if not self.dropout:  # nothing random to replay (and CUDA graph capture may not read RNG states)
                return torch_checkpoint(self._forward, x, residual, use_reentrant=False, preserve_rng_state=False,
                                        **attn_kw)
            return torch_checkpoint(self._forward, x, residual, use_reentrant=False,
                                    context_fn=self.rng_tracker.checkpoint_context_fns, **attn_kw)
        return self._forward(x, residual, **attn_kw)
