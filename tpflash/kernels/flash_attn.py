"""Triton flash attention forward (online softmax over key blocks) and its autograd.Function.

One program computes BLOCK_M query rows of one (sequence, q head). Scores are kept in the log2
domain (scale * log2(e) folded into one multiply) so the inner loop uses exp2. Key blocks
that need no mask (fully inside the sequence and below the causal diagonal) run in a loop
compiled without masking; only the boundary blocks pay for it. GQA: q head h reads kv head
h // groups straight from k/v, nothing is repeated. Varlen: sequence b spans rows
cu_seqlens[b]:cu_seqlens[b+1] of the packed tensors (batch stride 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import interpreting
from .reference import attention_reference

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


# (BLOCK_M, BLOCK_N, warps, stages) autotune candidates per kernel: few, to bound compile time
FWD_SHAPES = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]
DKDV_SHAPES = [(32, 128, 4, 3), (32, 128, 4, 5), (64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3)]
DQ_SHAPES = [(128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 2), (64, 64, 4, 3)]
# sequence lengths change every varlen batch: do not compile a kernel per divisibility class
NO_SPECIALIZE = ["seq_q", "seq_k", "max_seqlen_q", "max_seqlen_k"]


def attn_configs(shapes):
    """Autotune candidates (a single small one under the CPU interpreter)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@triton.jit
def seq_bounds(CU, b, seq_q, seq_k, VARLEN: tl.constexpr):
    """(first packed row, length of q, length of k) of sequence b."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
        return start, length, length
    return 0, seq_q, seq_k


@triton.jit
def _fwd_block(acc, m_i, l_i, q, K, V, sks, svs, start_n, offs_m, offs_n, offs_d, len_k, diag, scale_log2,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    n = start_n + offs_n
    if MASKED:
        kv_mask = (n < len_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        kv_mask = (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        keep = (n < len_k)[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] <= offs_m[:, None] + diag)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.autotune(configs=attn_configs(FWD_SHAPES), key=["HEAD_DIM", "CAUSAL", "VARLEN", "max_seqlen_q", "max_seqlen_k"])
@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _attn_fwd_kernel(Q, K, V, O, LSE, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, slb, slh,
                     heads_q, groups, seq_q, seq_k, max_seqlen_q, max_seqlen_k, scale_log2,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    b = tl.program_id(1) // heads_q
    h = tl.program_id(1) % heads_q
    start, len_q, len_k = seq_bounds(CU, b, seq_q, seq_k, VARLEN)
    if pid_m * BLOCK_M >= len_q:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (offs_m < len_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    Q += b * sqb + h * sqh + start * sqs
    K += b * skb + (h // groups) * skh + start * sks
    V += b * svb + (h // groups) * svh + start * svs
    q = tl.load(Q + offs_m[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = len_k - len_q  # query i sees keys j <= i + diag when causal
    hi = len_k
    unmasked_end = (len_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(len_k, (pid_m + 1) * BLOCK_M + diag), 0)
        first_row_limit = pid_m * BLOCK_M + diag + 1  # keys below this index are visible to every row
        unmasked_end = tl.minimum(unmasked_end, tl.maximum(first_row_limit, 0) // BLOCK_N * BLOCK_N)
    for start_n in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, sks, svs, start_n, offs_m, offs_n, offs_d, len_k, diag,
                                   scale_log2, HEAD_DIM, BLOCK_D, CAUSAL, False)
    for start_n in range(unmasked_end, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, K, V, sks, svs, start_n, offs_m, offs_n, offs_d, len_k, diag,
                                   scale_log2, HEAD_DIM, BLOCK_D, CAUSAL, True)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    O += b * sob + h * soh + start * sos
    tl.store(O + offs_m[:, None] * sos + offs_d[None, :], out.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + b * slb + h * slh + start + offs_m, lse, mask=offs_m < len_q)


class AttnGeometry:
    """Shapes and strides shared by the forward and backward launches (batched or varlen)."""

    def __init__(self, q, k, cu_seqlens, max_seqlen):
        self.varlen = cu_seqlens is not None
        if self.varlen:
            self.batch = cu_seqlens.numel() - 1
            self.seq_q = self.seq_k = q.shape[0]
            if max_seqlen is None:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            self.max_q = self.max_k = int(max_seqlen)
            self.cu = cu_seqlens
        else:
            self.batch, self.seq_q, self.seq_k = q.shape[0], q.shape[1], k.shape[1]
            self.max_q, self.max_k = self.seq_q, self.seq_k
            self.cu = q.new_zeros(1, dtype=torch.int32)  # unused
        self.heads_q, self.heads_kv, self.head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
        self.groups = self.heads_q // self.heads_kv
        self.block_d = max(16, triton.next_power_of_2(self.head_dim))

    def strides(self, t):
        """(batch, seq, head) strides; batch stride 0 for packed tensors."""
        return (0,) + tuple(t.stride()[:2]) if self.varlen else tuple(t.stride()[:3])

    def new_lse(self, q):
        """An empty fp32 log-sum-exp buffer: [batch, heads, seq], or [heads, total tokens] when packed."""
        if self.varlen:
            return torch.empty(self.heads_q, self.seq_q, device=q.device, dtype=torch.float32)
        return torch.empty(self.batch, self.heads_q, self.seq_q, device=q.device, dtype=torch.float32)

    def lse_strides(self, lse):
        """(batch, head) strides of the log-sum-exp buffer; batch stride 0 when packed."""
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))

    def bucket(self, n):
        """Autotune key: sequence lengths rounded up to a power of two (bounded recompiles)."""
        return triton.next_power_of_2(max(int(n), 16))


def attention_forward(q, k, v, causal, scale, geo: AttnGeometry):
    """Launch the forward kernel: (out shaped like q, fp32 log-sum-exp per query row)."""
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = geo.new_lse(q)
    grid = lambda meta: (triton.cdiv(geo.max_q, meta["BLOCK_M"]), geo.batch * geo.heads_q)  # noqa: E731
    _attn_fwd_kernel[grid](q, k, v, out, lse, geo.cu, *geo.strides(q), *geo.strides(k), *geo.strides(v),
                           *geo.strides(out), *geo.lse_strides(lse), geo.heads_q, geo.groups, geo.seq_q, geo.seq_k,
                           geo.bucket(geo.max_q), geo.bucket(geo.max_k), scale * LOG2E, HEAD_DIM=geo.head_dim,
                           BLOCK_D=geo.block_d, CAUSAL=causal, VARLEN=geo.varlen)
    return out, lse


class FlashAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v with the Triton kernels; returns (out, lse), lse not differentiable.
    q [b, s, h, d] (or packed [tokens, h, d] with cu_seqlens), k/v with h/groups heads (GQA)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, cu_seqlens, max_seqlen):
        geo = AttnGeometry(q, k, cu_seqlens, max_seqlen)
        out, lse = attention_forward(q, k, v, causal, scale, geo)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.geo, ctx.causal, ctx.scale = geo, causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        from .flash_attn_bwd import attention_backward
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, lse, grad_out, ctx.causal, ctx.scale, ctx.geo)
        return dq, dk, dv, None, None, None, None


def triton_flash_attention(q, k, v, causal, scale, cu_seqlens, max_seqlen):
    """(out, lse) from the Triton kernels; head dims above MAX_HEAD_DIM use the reference instead."""
    if q.shape[-1] > MAX_HEAD_DIM:
        return attention_reference(q, k, v, causal, scale, cu_seqlens, max_seqlen, return_lse=True)
    return FlashAttention.apply(q, k, v, causal, scale, cu_seqlens, max_seqlen)
