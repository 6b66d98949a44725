"""Tensor-parallel causal self-attention: q/k/v column-parallel, output row-parallel, heads sharded.

Rank r of tp holds q heads [r*Hq/tp, (r+1)*Hq/tp). Grouped-query attention (Hkv < Hq kv heads,
q head h reading kv head h // (Hq/Hkv)) works at any tp dividing Hq, in two layouts:
  * Hkv % tp == 0: kv heads are sharded like q heads (rank r holds kv heads [r*Hkv/tp, ...)).
  * tp % Hkv == 0: every rank needs exactly one kv head, kv head r // (tp/Hkv). The k/v weights
    are then *replicated* over tp (no shard spec, so full_state_dict is the tp=1 tensor as is);
    each rank multiplies by its head's rows only, and the weight's gradient, non-zero only in
    the rows each rank used, is all-reduced over tp (copy_to_tp_region), which sums the replicas'
    contributions into every row. This keeps ShardSpec's one-block-per-rank rule intact.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .. import kernels
from ..parallel.context_attention import CP_COMMS, context_parallel_attention
from ..parallel.sharding import ShardSpec
from ..parallel.state import group_rank, group_size, resolve_cp_group, resolve_tp_group, sublayer_group
from ..parallel.zigzag import zigzag_positions
from .autocast_linear import linear
from .block_weights import BlockWeights
from .fp8_linear import Fp8Amaxes, check_fp8_recipe
from .linear import (ColumnParallelLinear, InitMethod, RowParallelLinear, column_input_part, column_parallel_linears,
                     init_linear_full)
from .norm import HeadNorm
from .rotary import RotaryEmbedding


def check_heads(n_head: int, n_kv_head: int, tp: int) -> None:
    """Raise ValueError (naming the numbers) unless this head layout can run at this tp."""
    if n_head < 1 or n_kv_head < 1:
        raise ValueError(f"n_head={n_head} and n_kv_head={n_kv_head} must be >= 1")
    if n_head % n_kv_head:
        raise ValueError(f"n_head={n_head} is not divisible by n_kv_head={n_kv_head}")
    if n_head % tp:
        raise ValueError(f"n_head={n_head} is not divisible by tp={tp}")
    if n_kv_head % tp and tp % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} must divide or be divisible by tp={tp}")


class KVLinear(nn.Module):
    """The k or v projection: [*, hidden] -> [*, local_kv_heads * head_dim], sharded by kv head over
    tp when n_kv_head % tp == 0, else replicated with one head used per rank (module docstring).
    State-dict key "weight" ([n_kv_head*head_dim, hidden], nn.Linear's layout and init) and "bias".
    """

    def __init__(self, hidden: int, n_kv_head: int, head_dim: int, bias: bool = True, process_group=None,
                 *, init_method: Optional[InitMethod] = None, device=None, dtype=None):
        super().__init__()
        self.process_group = resolve_tp_group(process_group)
        tp, rank = group_size(self.process_group), group_rank(self.process_group)
        out = n_kv_head * head_dim
        self.replicated = n_kv_head < tp
        weight, b = init_linear_full(out, hidden, bias, init_method, device, dtype)
        if self.replicated:
            head = rank // (tp // n_kv_head)
            self.rows = slice(head * head_dim, (head + 1) * head_dim)
            self.tp_shard_specs = {}
        else:
            self.tp_shard_specs = {"weight": ShardSpec(0, out)}
            weight = self.tp_shard_specs["weight"].shard(weight, rank, tp)
            if bias:
                self.tp_shard_specs["bias"] = ShardSpec(0, out)
                b = self.tp_shard_specs["bias"].shard(b, rank, tp)
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(b) if bias else None
        self.block_weights = BlockWeights()  # its block's, once in one: the replicated weights' aliases

    def tp_partial_grad_parameters(self) -> List[nn.Parameter]:
        """The parameters whose gradient each tp rank holds only a part of: replicated weight and bias."""
        return [p for p in (self.weight, self.bias) if p is not None] if self.replicated else []

    def local_weight_and_bias(self):
        """The [local_kv_heads*head_dim, hidden] weight (and bias) this rank multiplies by; replicated
        weights go through copy_to_tp_region (or their block's alias) so their gradient is summed over
        the replicas."""
        if not self.replicated:
            return self.weight, self.bias
        weight, bias = self.block_weights.summed_over_tp([self.weight, self.bias], self.process_group)
        return weight[self.rows], None if bias is None else bias[self.rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the already gathered/copied column input (see `column_parallel_linears`)."""
        return linear(x, *self.local_weight_and_bias())


class ParallelAttention(nn.Module):
    """Causal multi-head / grouped-query self-attention over tp (module docstring for the layout).

    x: [seq, batch, hidden] replicated over tp, or with sequence_parallel [seq/tp, batch, hidden];
    the output has the same layout as x. position="rotary" rotates q and k (RoPE, theta=rope_theta,
    frequency scaling `rope_scaling` as in tpflash.layers.rotary, `max_positions` the model's
    max_position_embeddings); "learned" (or "none") leaves positions to the embedding.
    head_dim: per-head width (default hidden // n_head; n_head * head_dim may differ from hidden).
    qkv_bias: biases on q/k/v (default `bias`); `bias` alone sets o_proj's. qk_norm: a per-head RMSNorm
    (eps=norm_eps) on q and k after the projection, before rotary (Qwen3).
    The core is tpflash.kernels.flash_attention on [batch, seq, heads, head_dim] views, or with
    cu_seqlens on its varlen form (see `forward`). Context parallelism: with a cp group (`cp_group`,
    else the default state's when its cp > 1; NO_GROUP for none), x holds this cp rank's seq/cp tokens
    in the zigzag layout (tpflash.parallel.zigzag) and attention runs over the whole sequence through
    tpflash.parallel.context_attention (`cp_comm` "ring" or "allgather"); heads stay split over tp.
    fp8 "rowwise" / "tensorwise": the q/k/v and o GEMMs in fp8 (tpflash.layers.fp8_linear, docs/fp8.md).
    Parameters: q_proj, k_proj, v_proj, o_proj (nn.Linear layouts; keys as a plain module's), and
    q_norm.weight / k_norm.weight ([head_dim], replicated) with qk_norm.
    `out_init_method` initialises o_proj (e.g. GPT-2's 1/sqrt(2*n_layer) scaled init).
    `block_weights`: its block's (tpflash.layers.block_weights), for the q/k/v weights' casts.
    """

    def __init__(self, hidden: int, n_head: int, n_kv_head: Optional[int] = None, bias: bool = True,
                 position: str = "learned", rope_theta: float = 10000.0, sequence_parallel: bool = False,
                 process_group=None, *, head_dim: Optional[int] = None, qkv_bias: Optional[bool] = None,
                 qk_norm: bool = False, norm_eps: float = 1e-6, rope_scaling: Optional[Dict[str, Any]] = None,
                 max_positions: int = 2048, softmax_scale: Optional[float] = None,
                 init_method: Optional[InitMethod] = None, out_init_method: Optional[InitMethod] = None,
                 cp_group=None, cp_comm: str = "ring", fp8: str = "off", device=None, dtype=None):
        super().__init__()
        if cp_comm not in CP_COMMS:
            raise ValueError(f"cp_comm={cp_comm!r} must be one of {CP_COMMS}")
        check_fp8_recipe(fp8)
        self.cp_group, self.cp_comm, self.fp8 = resolve_cp_group(cp_group), cp_comm, fp8
        self.fp8_history = None  # fp8="delayed": the q/k/v GEMM's amax histories (tpflash.layers.fp8_history)
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.process_group = resolve_tp_group(process_group)
        tp = group_size(self.process_group)
        check_heads(n_head, n_kv_head, tp)
        if head_dim is None and hidden % n_head:
            raise ValueError(f"hidden={hidden} is not divisible by n_head={n_head} (pass head_dim)")
        if position not in ("learned", "rotary", "none"):
            raise ValueError(f"position={position!r} must be 'learned', 'rotary' or 'none'")
        self.hidden, self.n_head, self.n_kv_head = hidden, n_head, n_kv_head
        self.head_dim = hidden // n_head if head_dim is None else head_dim
        self.local_heads, self.local_kv_heads = n_head // tp, max(1, n_kv_head // tp)
        self.sequence_parallel = sequence_parallel
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        inner = n_head * self.head_dim
        kw = dict(process_group=sublayer_group(self.process_group), init_method=init_method, device=device, dtype=dtype)
        self.q_proj = ColumnParallelLinear(hidden, inner, bias=qkv_bias, **kw)
        self.k_proj = KVLinear(hidden, n_kv_head, self.head_dim, bias=qkv_bias, **kw)
        self.v_proj = KVLinear(hidden, n_kv_head, self.head_dim, bias=qkv_bias, **kw)
        self.o_proj = RowParallelLinear(inner, hidden, bias=bias, sequence_parallel=sequence_parallel,
                                        process_group=sublayer_group(self.process_group), init_method=out_init_method,
                                        fp8=fp8, device=device, dtype=dtype)
        self.q_norm = self.k_norm = None
        if qk_norm:
            norm_kw = dict(eps=norm_eps, process_group=sublayer_group(self.process_group), device=device, dtype=dtype)
            self.q_norm, self.k_norm = HeadNorm(self.head_dim, **norm_kw), HeadNorm(self.head_dim, **norm_kw)
        self.block_weights = BlockWeights()  # its block's, once in one
        self.rotary = None
        if position == "rotary":
            self.rotary = RotaryEmbedding(self.head_dim, rope_theta, rope_scaling, max_positions)

    def fp8_weight_groups(self) -> Optional[List[Tuple[torch.Tensor, ...]]]:
        """The weights each of its fp8 GEMMs casts with one tensorwise scale (q/k/v stacked, o), or None
        where a GEMM multiplies rows of a weight rather than the weight (replicated k/v)."""
        if self.k_proj.replicated:
            return None
        return [(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight), (self.o_proj.weight,)]

    def weight_cast_groups(self) -> List[Tuple[Optional[torch.Tensor], ...]]:
        """The tensors forward casts to the compute dtype, grouped as it stacks them (weight_casts.prepare_cast).
        (q_norm/k_norm weights are not cast: the norm kernel reads them in fp32, like the block norms'.)
        None under fp8: its GEMMs cast the weights to fp8 themselves."""
        if self.fp8 != "off":
            return []
        groups = [(self.o_proj.weight,), (self.o_proj.bias,)]
        if not self.k_proj.replicated:  # replicated k/v multiply one head's rows of their weight
            projections = (self.q_proj, self.k_proj, self.v_proj)
            groups += [tuple(p.weight for p in projections), tuple(p.bias for p in projections)]
        return groups

    def input_part(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """Where forward's x (shaped like `like`) may be written by its producer so that the q/k/v
        projection's gather takes it without a copy (tpflash.layers.linear.column_input_part), or None."""
        return column_input_part(like, self.q_proj.weight, self.process_group, self.sequence_parallel,
                                 self.q_proj.overlap, fp8=self.fp8)

    def _project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x -> q, k, v as [seq, batch, heads, head_dim] (q/k normalised per head with qk_norm)."""
        (k_w, k_b), (v_w, v_b) = self.k_proj.local_weight_and_bias(), self.v_proj.local_weight_and_bias()
        q, k, v = column_parallel_linears(x, [self.q_proj.weight, k_w, v_w], [self.q_proj.bias, k_b, v_b],
                                          self.process_group, self.sequence_parallel, self.q_proj.overlap,
                                          fp8=self.fp8, fp8_amaxes=Fp8Amaxes(history=self.fp8_history),
                                          casts=self.block_weights.casts)  # [seq, b, heads*hd]
        seq, batch = q.shape[0], q.shape[1]
        q = q.view(seq, batch, self.local_heads, self.head_dim)
        k = k.view(seq, batch, self.local_kv_heads, self.head_dim)
        v = v.view(seq, batch, self.local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
        """x as in the class docstring. Packed documents (all optional, for the whole, gathered sequence):
        position_ids [batch, seq] int64, each token's position (rotary angles; default 0..seq-1);
        cu_seqlens int32 [n_docs + 1], document offsets in the batch-major flattening of [batch, seq]
        (no token attends across one); max_seqlen the longest document (also the rotary length of
        dynamic/longrope scaling; default seq). Under context parallelism: this rank's tokens' global
        positions (default: the zigzag layout's) and max_seqlen the whole sequence's length."""
        q, k, v = self._project(x)
        seq, batch = q.shape[0], q.shape[1]
        if self.cp_group is not None:
            out = self._context_parallel_attention(q, k, v, position_ids, cu_seqlens, max_seqlen)
        elif position_ids is None and cu_seqlens is None:  # [seq, b, h, hd] -> [b, seq, h, hd] views, no copy
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            if self.rotary is not None:
                q, k = self.rotary(q, k)
            out = kernels.flash_attention(q, k, v, causal=True, softmax_scale=self.softmax_scale)  # [b, seq, h, hd]
            out = out.transpose(0, 1)
        else:
            out = self._packed_attention(q, k, v, position_ids, cu_seqlens, max_seqlen)
        # contiguous: a [seq, b, hidden] view of [b, seq, ...] memory would make o_proj a batched GEMM of
        # `batch` rows per matrix, several times slower than one GEMM over every token (measured on an
        # H100 for packed batches, whose varlen output is batch-major: docs/performance.md, "Fine-tuning")
        out = out.reshape(seq, batch, self.local_heads * self.head_dim).contiguous()
        return self.o_proj(out)  # [seq(/tp), b, hidden]

    def _rotate(self, q, k, position_ids, rotary_len):
        """q/k [seq, b, heads, hd] rotated at position_ids [b, seq] (rotary tables for `rotary_len`)."""
        if self.rotary is None:
            return q, k
        seq, batch = q.shape[0], q.shape[1]
        tokens = position_ids.t().reshape(-1)  # the [seq, b] token order of q and k
        q, k = self.rotary(q.reshape(seq * batch, *q.shape[2:]), k.reshape(seq * batch, *k.shape[2:]),
                           tokens, rotary_len)
        return q.reshape(seq, batch, *q.shape[1:]), k.reshape(seq, batch, *k.shape[1:])

    def _context_parallel_attention(self, q, k, v, position_ids, cu_seqlens, max_seqlen) -> torch.Tensor:
        """This cp rank's q/k/v [seq/cp, b, heads, hd] -> out [seq/cp, b, heads, hd] over the whole sequence."""
        cp = self.cp_group.size()
        if cu_seqlens is not None:
            raise ValueError(f"packed documents (cu_seqlens) are not supported under context parallelism "
                             f"(cp={cp}): train on unpacked rows, or at cp=1")
        seq, batch = q.shape[0], q.shape[1]
        if position_ids is None:
            position_ids = zigzag_positions(seq * cp, self.cp_group.rank(), cp, q.device).expand(batch, seq)
        q, k = self._rotate(q, k, position_ids, max_seqlen or seq * cp)
        out = context_parallel_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.cp_group,
                                         causal=True, softmax_scale=self.softmax_scale, cp_comm=self.cp_comm)
        return out.transpose(0, 1)

    def _packed_attention(self, q, k, v, position_ids, cu_seqlens, max_seqlen) -> torch.Tensor:
        """q/k/v [seq, b, heads, hd] -> out [seq, b, heads, hd], rotary at position_ids, attention kept
        within the documents of cu_seqlens (causal over each row without it)."""
        seq, batch = q.shape[0], q.shape[1]
        if position_ids is None:
            position_ids = torch.arange(seq, device=q.device).expand(batch, seq)
        q, k = self._rotate(q, k, position_ids, max_seqlen or seq)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [b, seq, h, hd]
        if cu_seqlens is None:
            return kernels.flash_attention(q, k, v, causal=True, softmax_scale=self.softmax_scale).transpose(0, 1)
        flat = [t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v)]  # batch-major, as cu_seqlens counts
        out = kernels.flash_attention(*flat, causal=True, softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens,
                                      max_seqlen=max_seqlen)
        return out.reshape(batch, seq, *out.shape[1:]).transpose(0, 1)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, "
                f"head_dim={self.head_dim}, tp={group_size(self.process_group)}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (f", cp={self.cp_group.size()}, cp_comm={self.cp_comm}" if self.cp_group is not None else ""))
