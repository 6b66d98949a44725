"""Plain single-process PyTorch references for the parallel blocks (nn.Linear, SDPA, nn.LayerNorm),
with the same parameter names, so a parallel module's full_state_dict loads into them as is."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from tpflash.parallel import comm, full_state_dict
from tpflash.parallel.sharding import iter_sharded


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind, dim, eps, bias):
    return nn.LayerNorm(dim, eps=eps, bias=bias) if kind == "layernorm" else RMSNorm(dim, eps)


def rotate(x, theta):
    """RoPE, rotate-half layout, on x [batch, heads, seq, hd]."""
    d, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RefAttention(nn.Module):
    """Plain attention; head_dim (default hidden // n_head), qkv_bias (default bias) and qk_norm (per-head
    RMSNorm of q and k before rotary, Qwen3) as ParallelAttention's."""

    def __init__(self, hidden, n_head, n_kv_head, bias=True, rotary=False, theta=10000.0, head_dim=None,
                 qkv_bias=None, qk_norm=False, eps=1e-6):
        super().__init__()
        self.n_head, self.n_kv_head, self.rotary, self.theta = n_head, n_kv_head, rotary, theta
        self.hd = hidden // n_head if head_dim is None else head_dim
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(hidden, n_head * self.hd, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, n_kv_head * self.hd, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, n_kv_head * self.hd, bias=qkv_bias)
        self.o_proj = nn.Linear(n_head * self.hd, hidden, bias=bias)
        self.q_norm = RMSNorm(self.hd, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.hd, eps) if qk_norm else None

    def forward(self, x):  # [seq, batch, hidden]
        s, b, _ = x.shape
        q = self.q_proj(x).view(s, b, self.n_head, self.hd)
        k = self.k_proj(x).view(s, b, self.n_kv_head, self.hd)
        v = self.v_proj(x).view(s, b, self.n_kv_head, self.hd).permute(1, 2, 0, 3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
        if self.rotary:
            q, k = rotate(q, self.theta), rotate(k, self.theta)
        rep = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, H, s, hd]
        return self.o_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class RefMLP(nn.Module):
    def __init__(self, hidden, ffn, mlp="gelu", bias=True):
        super().__init__()
        self.mlp = mlp
        self.up_proj = nn.Linear(hidden, ffn, bias=bias)
        self.gate_proj = nn.Linear(hidden, ffn, bias=bias) if mlp == "swiglu" else None
        self.down_proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        if self.mlp == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        act = functools.partial(F.gelu, approximate="tanh") if self.mlp == "gelu" else F.gelu
        return self.down_proj(act(self.up_proj(x)))


class RefBlock(nn.Module):
    def __init__(self, hidden, n_head, n_kv_head, ffn, mlp, norm, rotary, bias, eps=1e-5):
        super().__init__()
        norm_bias = bias and norm == "layernorm"
        self.attn_norm = make_norm(norm, hidden, eps, norm_bias)
        self.attn = RefAttention(hidden, n_head, n_kv_head, bias, rotary)
        self.mlp_norm = make_norm(norm, hidden, eps, norm_bias)
        self.mlp = RefMLP(hidden, ffn, mlp, bias)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def full_grads(module):
    """{parameter name: unsharded gradient} of a tp module (collective over its tp groups)."""
    specs = {key: (spec, group) for key, spec, group in iter_sharded(module)}
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if name in specs:
            spec, group = specs[name]
            g = spec.unpad(comm.all_gather(g, spec.dim, group))
        out[name] = g
    return out


def seq_rows(seq, rank, tp, sequence_parallel):
    """This rank's sequence slice under SP (everything otherwise)."""
    return slice(rank * seq // tp, (rank + 1) * seq // tp) if sequence_parallel else slice(None)


def check_against_reference(ps, layer, ref, hidden, sequence_parallel, seq=8, batch=2, seed=1234):
    """Load layer's weights into ref, run both on the same [seq, batch, hidden] input (sharded on the
    sequence under SP) and compare the output, the input gradient and every parameter gradient."""
    from tests.distributed.checks import assert_close

    ref.load_state_dict(full_state_dict(layer))
    torch.manual_seed(seed)  # same data on every rank
    x = torch.randn(seq, batch, hidden)
    grad = torch.randn(seq, batch, hidden)
    rows = seq_rows(seq, ps.tp_rank, ps.tp_size, sequence_parallel)
    x_local, x_ref = x[rows].clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x_local)
    if isinstance(out, tuple):  # a block: the residual stream is out + residual
        out = out[0] + out[1]
    expected = ref(x_ref)
    assert_close(out, expected[rows], "output")
    out.backward(grad[rows])
    expected.backward(grad)
    assert_close(x_local.grad, x_ref.grad[rows], "input grad")
    ref_grads = dict(ref.named_parameters())
    for name, g in full_grads(layer).items():
        assert_grad_close(g, ref_grads[name].grad, f"grad of {name}")


def assert_grad_close(actual, expected, name, tol=None):
    """Relative error (at most `tol`, default by dtype), except for gradients that are zero in exact
    arithmetic (a key bias shifts every score of a query equally, which softmax ignores): both are
    rounding noise there, and must be absolutely tiny."""
    from tests.distributed.checks import assert_close

    if name.endswith("k_proj.bias"):
        assert (actual - expected).abs().max() < 1e-5, f"{name}: {actual} != {expected}"
    else:
        assert_close(actual, expected, name, tol=tol)
