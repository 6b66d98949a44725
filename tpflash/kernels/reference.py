"""Plain-PyTorch references for every kernel: the CPU path, and the ground truth of the tests.

They compute in fp32 (float64 if given float64) and return the input dtype, like the kernels.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def _attention_one(q, k, v, causal: bool, scale: float):
    """q [b, sq, hq, d], k/v [b, sk, hkv, d] -> (out [b, sq, hq, d], lse [b, hq, sq]) in the compute dtype."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # [b, hq, sq, sk]
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        # bottom-right aligned (flash-attn >= 2.1): query i sees keys j <= i + sk - sq
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [b, hq, sq]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # fully masked rows give 0
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def attention_reference(q, k, v, causal: bool = False, softmax_scale: Optional[float] = None,
                        cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                        return_lse: bool = False):
    """softmax(q k^T * scale [+ causal mask]) v, per head; kv head h // (hq/hkv) serves q head h.

    Batched: q [b, sq, hq, d], k/v [b, sk, hkv, d] -> out [b, sq, hq, d], lse [b, hq, sq].
    Varlen: q/k/v [total, h, d], sequences cu_seqlens[i]:cu_seqlens[i+1] -> out [total, hq, d],
    lse [hq, total]. Differentiable through autograd. Rows that see no key give 0 (lse = -inf).
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc, kc, vc = q.to(compute), k.to(compute), v.to(compute)
    if cu_seqlens is None:
        out, lse = _attention_one(qc, kc, vc, causal, scale)
    else:
        outs, lses = [], []
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            o, l = _attention_one(qc[None, start:end], kc[None, start:end], vc[None, start:end], causal, scale)
            outs.append(o[0])
            lses.append(l[0])
        out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=-1)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_lse else out


def _norm_input(x, residual):
    """(fp32 input of the norm, new residual or None). The sum is normalised as stored, rounded to the
    residual's dtype: the norm of the new residual, which is what its backward and a recomputation see."""
    if residual is None:
        return x.float() if x.dtype != torch.float64 else x, None
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    new_residual = (x.to(compute) + residual.to(compute)).to(residual.dtype)
    return new_residual.to(compute), new_residual


def layer_norm_reference(x, weight, bias=None, eps: float = 1e-5, residual=None):
    """LayerNorm over the last dim with fp32 statistics; with `residual`: (LN(x + residual), x + residual)."""
    h, new_residual = _norm_input(x, residual)
    mean = h.mean(dim=-1, keepdim=True)
    var = (h - mean).square().mean(dim=-1, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps) * weight.to(h.dtype)
    if bias is not None:
        y = y + bias.to(h.dtype)
    y = y.to(x.dtype)
    return y if residual is None else (y, new_residual)


def rms_norm_reference(x, weight, eps: float = 1e-6, residual=None):
    """x * rsqrt(mean(x^2) + eps) * weight with fp32 statistics; with `residual`: (y, x + residual)."""
    h, new_residual = _norm_input(x, residual)
    y = (h * torch.rsqrt(h.square().mean(dim=-1, keepdim=True) + eps) * weight.to(h.dtype)).to(x.dtype)
    return y if residual is None else (y, new_residual)


def rotary_reference(x, cos, sin, interleaved: bool = False):
    """Rotate the first 2*cos.shape[-1] features of x by the angles whose cos/sin are given.

    x [..., seq, heads, head_dim]; cos/sin [seq, rotary_dim/2]. Half-split (GPT-NeoX/Llama):
    pairs (i, i + rotary_dim/2); interleaved (GPT-J): pairs (2i, 2i+1). Features past
    rotary_dim pass through. Out of place, differentiable.
    """
    half = cos.shape[-1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(compute)[:, None, :]  # [seq, 1, half]
    s = sin.to(compute)[:, None, :]
    rot, rest = x[..., : 2 * half].to(compute), x[..., 2 * half:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def cross_entropy_stats_reference(logits, target_col, real_cols: int, with_sum: bool = False
                                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [n, v]: (max, sum exp(x - max), x[target_col], sum x), fp32, over the first
    `real_cols` columns. target_col [n] is the local column of the target, or -1 when the target is
    not in this shard (its logit is then 0). The sum is zeros unless `with_sum`.
    """
    x = logits[:, :real_cols].float()
    if real_cols == 0:  # a shard of padding only
        row_max = x.new_full((x.shape[0],), float("-inf"))
        sum_exp = x.new_zeros(x.shape[0])
    else:
        row_max = x.max(dim=-1).values
        sum_exp = (x - row_max[:, None]).exp().sum(-1)
    mine = target_col >= 0
    picked = logits.float().gather(1, target_col.clamp_min(0)[:, None].long()).squeeze(1).masked_fill(~mine, 0.0)
    total = x.sum(-1) if with_sum else torch.zeros_like(row_max)
    return row_max, sum_exp, picked, total


def cross_entropy_grad_reference(logits, lse, target_col, row_scale, real_cols: int,
                                 label_smoothing: float = 0.0, num_classes: int = 1, z_loss: float = 0.0):
    """d loss / d logits for logits [n, v], fp32 lse [n] (global log-sum-exp) and row_scale [n]
    (upstream gradient, 0 at ignored rows): row_scale * (softmax * (1 + 2 z lse) - (1 - ls) onehot
    - ls / num_classes on real columns); padding columns get 0. Returns logits' dtype.
    """
    x = logits.float()
    grad = (x - lse[:, None]).exp() * (1 + 2 * z_loss * lse[:, None])
    cols = torch.arange(x.shape[1], device=x.device)
    onehot = (cols[None, :] == target_col[:, None]).float()
    grad = grad - (1 - label_smoothing) * onehot - label_smoothing / num_classes
    grad = grad.masked_fill(cols[None, :] >= real_cols, 0.0)
    return (grad * row_scale[:, None]).to(logits.dtype)


# The elementwise activations of a non-gated MLP. "gelu" is the tanh approximation GPT-2 uses
# (Hugging Face's "gelu_new"); "gelu_exact" is the erf form.
ACTIVATION_FUNCTIONS = {"gelu": functools.partial(F.gelu, approximate="tanh"), "gelu_exact": F.gelu, "relu": F.relu}


def bias_activation_reference(y: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """act(y + bias) in fp32 (float64 for float64 y), returned in y's dtype; differentiable."""
    compute = torch.float64 if y.dtype == torch.float64 else torch.float32
    return ACTIVATION_FUNCTIONS[activation](y.to(compute) + bias.to(compute)).to(y.dtype)


def swiglu_reference(up: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32 (float64 for float64 up), returned in up's dtype; differentiable."""
    compute = torch.float64 if up.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(compute)) * up.to(compute)).to(up.dtype)
