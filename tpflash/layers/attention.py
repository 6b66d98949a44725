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
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from .. import kernels
from ..parallel import comm
from ..parallel.sharding import ShardSpec
from ..parallel.state import group_rank, group_size, resolve_tp_group
from .autocast_linear import linear
from .linear import ColumnParallelLinear, InitMethod, RowParallelLinear, column_parallel_linears, init_linear_full
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

    def tp_partial_grad_parameters(self) -> List[nn.Parameter]:
        """The parameters whose gradient each tp rank holds only a part of: replicated weight and bias."""
        return [p for p in (self.weight, self.bias) if p is not None] if self.replicated else []

    def local_weight_and_bias(self):
        """The [local_kv_heads*head_dim, hidden] weight (and bias) this rank multiplies by; replicated
        weights pass through copy_to_tp_region so their gradient is summed over the replicas."""
        weight, bias = self.weight, self.bias
        if self.replicated:
            if bias is None:
                weight = comm.copy_to_tp_region(weight, self.process_group)[self.rows]
            else:
                weight, bias = comm.copy_to_tp_region_many([weight, bias], self.process_group)
                weight, bias = weight[self.rows], bias[self.rows]
        return weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the already gathered/copied column input (see `column_parallel_linears`)."""
        return linear(x, *self.local_weight_and_bias())


class ParallelAttention(nn.Module):
    """Causal multi-head / grouped-query self-attention over tp (module docstring for the layout).

    x: [seq, batch, hidden] replicated over tp, or with sequence_parallel [seq/tp, batch, hidden];
    the output has the same layout as x. position="rotary" rotates q and k (RoPE, theta=rope_theta);
    "learned" (or "none") leaves positions to the embedding. The core is
    tpflash.kernels.flash_attention on [batch, seq, heads, head_dim] views.
    Parameters: q_proj, k_proj, v_proj, o_proj (nn.Linear layouts; keys as a plain module's).
    `out_init_method` initialises o_proj (e.g. GPT-2's 1/sqrt(2*n_layer) scaled init).
    """

    def __init__(self, hidden: int, n_head: int, n_kv_head: Optional[int] = None, bias: bool = True,
                 position: str = "learned", rope_theta: float = 10000.0, sequence_parallel: bool = False,
                 process_group=None, *, softmax_scale: Optional[float] = None,
                 init_method: Optional[InitMethod] = None, out_init_method: Optional[InitMethod] = None,
                 device=None, dtype=None):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.process_group = resolve_tp_group(process_group)
        tp = group_size(self.process_group)
        check_heads(n_head, n_kv_head, tp)
        if hidden % n_head:
            raise ValueError(f"hidden={hidden} is not divisible by n_head={n_head}")
        if position not in ("learned", "rotary", "none"):
            raise ValueError(f"position={position!r} must be 'learned', 'rotary' or 'none'")
        self.hidden, self.n_head, self.n_kv_head, self.head_dim = hidden, n_head, n_kv_head, hidden // n_head
        self.local_heads, self.local_kv_heads = n_head // tp, max(1, n_kv_head // tp)
        self.sequence_parallel = sequence_parallel
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        kw = dict(process_group=self.process_group, init_method=init_method, device=device, dtype=dtype)
        self.q_proj = ColumnParallelLinear(hidden, hidden, bias=bias, **kw)
        self.k_proj = KVLinear(hidden, n_kv_head, self.head_dim, bias=bias, **kw)
        self.v_proj = KVLinear(hidden, n_kv_head, self.head_dim, bias=bias, **kw)
        self.o_proj = RowParallelLinear(hidden, hidden, bias=bias, sequence_parallel=sequence_parallel,
                                        process_group=self.process_group, init_method=out_init_method,
                                        device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(self.head_dim, rope_theta) if position == "rotary" else None

    def weight_cast_groups(self) -> List[Tuple[Optional[torch.Tensor], ...]]:
        """The tensors forward casts to the compute dtype, grouped as it stacks them (weight_casts.cast_once)."""
        groups = [(self.o_proj.weight,), (self.o_proj.bias,)]
        if not self.k_proj.replicated:  # replicated k/v multiply one head's rows of their weight
            projections = (self.q_proj, self.k_proj, self.v_proj)
            groups += [tuple(p.weight for p in projections), tuple(p.bias for p in projections)]
        return groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (k_w, k_b), (v_w, v_b) = self.k_proj.local_weight_and_bias(), self.v_proj.local_weight_and_bias()
        q, k, v = column_parallel_linears(x, [self.q_proj.weight, k_w, v_w], [self.q_proj.bias, k_b, v_b],
                                          self.process_group, self.sequence_parallel)  # [seq, b, heads*hd]
        seq, batch = q.shape[0], q.shape[1]
        # [seq, b, heads*hd] -> [b, seq, heads, hd] views (no copy; the kernel takes strides)
        q = q.view(seq, batch, self.local_heads, self.head_dim)
        k = k.view(seq, batch, self.local_kv_heads, self.head_dim)
        v = v.view(seq, batch, self.local_kv_heads, self.head_dim)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        out = kernels.flash_attention(q, k, v, causal=True, softmax_scale=self.softmax_scale)  # [b, seq, h, hd]
        out = out.transpose(0, 1).reshape(seq, batch, self.local_heads * self.head_dim)
        return self.o_proj(out)  # [seq(/tp), b, hidden]

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, "
                f"head_dim={self.head_dim}, tp={group_size(self.process_group)}, "
                f"sequence_parallel={self.sequence_parallel}")
