"""Triton flash attention backward: delta = rowsum(dO * O), then dK/dV and dQ in two kernels.

dK/dV: one program owns BLOCK_N keys of one (sequence, kv head) and loops over every q head of
its GQA group and every query block that can see those keys, so GQA gradients are summed in
registers (no atomics, no repeated kv). dQ: one program owns BLOCK_M queries of one q head and
loops over the key blocks it sees. Probabilities are recomputed from the saved log-sum-exp;
lse = -inf (a row that sees no key) is loaded as +inf so its probabilities come out 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flash_attn import DKDV_SHAPES, DQ_SHAPES, LOG2E, NO_SPECIALIZE, AttnGeometry, attn_configs, seq_bounds


@triton.jit
def _delta_kernel(O, DO, DELTA, sob, sos, soh, sdb, sds, sdh, slb, slh, heads_q, seq_q, CU,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // heads_q
    h = tl.program_id(1) % heads_q
    start, len_q, _ = seq_bounds(CU, b, seq_q, seq_q, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < len_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (start + offs_m)[:, None]
    o = tl.load(O + b * sob + h * soh + rows * sos + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sdb + h * sdh + rows * sds + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + b * slb + h * slh + start + offs_m, tl.sum(o * do, 1), mask=offs_m < len_q)


@triton.jit
def _probs(q, k, lse_log2, offs_m, n, len_q, len_k, diag, scale_log2, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    """P^T [BLOCK_N, BLOCK_M] for keys n (rows) and queries offs_m (columns)."""
    p = tl.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse_log2[None, :])
    if MASKED:
        keep = (n < len_k)[:, None] & (offs_m < len_q)[None, :]
        if CAUSAL:
            keep = keep & (n[:, None] <= offs_m[None, :] + diag)
        p = tl.where(keep, p, 0.0)
    return p


@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, LSE, DELTA, sqs, sds, start_m, offs_m0, n, offs_d, len_q, len_k, diag,
                scale_log2, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    offs_m = start_m + offs_m0
    if MASKED:
        q_mask = (offs_m < len_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        q_mask = (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + offs_m[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    do = tl.load(DO + offs_m[:, None] * sds + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + offs_m, mask=offs_m < len_q, other=float("inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + offs_m, mask=offs_m < len_q, other=0.0)
    pt = _probs(q, k, lse_log2, offs_m, n, len_q, len_k, diag, scale_log2, CAUSAL, MASKED)  # [BLOCK_N, BLOCK_M]
    dv += tl.dot(pt.to(do.dtype), do)
    dpt = tl.dot(v, tl.trans(do))  # [BLOCK_N, BLOCK_M]
    dst = pt * (dpt - delta[None, :])
    dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv


@triton.autotune(configs=attn_configs(DKDV_SHAPES), key=["HEAD_DIM", "CAUSAL", "VARLEN", "max_seqlen_q", "max_seqlen_k"])
@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _attn_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh,
                      sdb, sds, sdh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh, slb, slh, heads_kv, groups, seq_q, seq_k,
                      max_seqlen_q, max_seqlen_k, scale_log2, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1) // heads_kv
    hk = tl.program_id(1) % heads_kv
    start, len_q, len_k = seq_bounds(CU, b, seq_q, seq_k, VARLEN)
    if pid_n * BLOCK_N >= len_k:
        return
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (n < len_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + b * skb + hk * skh + (start + n)[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + (start + n)[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    diag = len_k - len_q
    lo = 0
    masked_end = 0
    if CAUSAL:  # query rows below pid_n*BLOCK_N - diag see none of these keys; past the block's last key + diag, all
        lo = tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M * BLOCK_M
        masked_end = tl.minimum(tl.maximum((pid_n + 1) * BLOCK_N - diag, 0), len_q)
        masked_end = tl.cdiv(masked_end - lo, BLOCK_M) * BLOCK_M + lo
    unmasked_end = tl.maximum(masked_end, lo + (len_q - lo) // BLOCK_M * BLOCK_M)
    edge = (pid_n + 1) * BLOCK_N > len_k  # the last key block needs the key bound everywhere
    for g in range(0, groups):
        h = hk * groups + g
        Qh = Q + b * sqb + h * sqh + start * sqs
        DOh = DO + b * sdb + h * sdh + start * sds
        LSEh = LSE + b * slb + h * slh + start
        DELTAh = DELTA + b * slb + h * slh + start
        for start_m in range(lo, masked_end, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sds, start_m, offs_m0, n, offs_d,
                                 len_q, len_k, diag, scale_log2, HEAD_DIM, CAUSAL, True)
        if edge:
            for start_m in range(masked_end, len_q, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sds, start_m, offs_m0, n, offs_d,
                                     len_q, len_k, diag, scale_log2, HEAD_DIM, CAUSAL, True)
        else:
            for start_m in range(masked_end, unmasked_end, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sds, start_m, offs_m0, n, offs_d,
                                     len_q, len_k, diag, scale_log2, HEAD_DIM, CAUSAL, False)
            for start_m in range(unmasked_end, len_q, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, Qh, DOh, LSEh, DELTAh, sqs, sds, start_m, offs_m0, n, offs_d,
                                     len_q, len_k, diag, scale_log2, HEAD_DIM, CAUSAL, True)
    dk *= scale_log2 / 1.4426950408889634
    tl.store(DK + b * sdkb + hk * sdkh + (start + n)[:, None] * sdks + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + (start + n)[:, None] * sdvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_block(dq, q, do, lse_log2, delta, K, V, sks, svs, start_n, offs_m, offs_n, offs_d, len_q, len_k, diag,
              scale_log2, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr):
    n = start_n + offs_n
    if MASKED:
        kv_mask = (n < len_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    else:
        kv_mask = (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + n[:, None] * sks + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(V + n[:, None] * svs + offs_d[None, :], mask=kv_mask, other=0.0)
    pt = _probs(q, k, lse_log2, offs_m, n, len_q, len_k, diag, scale_log2, CAUSAL, MASKED)  # [BLOCK_N, BLOCK_M]
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    dq += tl.dot(tl.trans(dst).to(k.dtype), k)
    return dq


@triton.autotune(configs=attn_configs(DQ_SHAPES), key=["HEAD_DIM", "CAUSAL", "VARLEN", "max_seqlen_q", "max_seqlen_k"])
@triton.jit(do_not_specialize=NO_SPECIALIZE)
def _attn_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdb, sds, sdh,
                    sdqb, sdqs, sdqh, slb, slh, heads_q, groups, seq_q, seq_k, max_seqlen_q, max_seqlen_k, scale_log2,
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
    q = tl.load(Q + b * sqb + h * sqh + (start + offs_m)[:, None] * sqs + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + (start + offs_m)[:, None] * sds + offs_d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + start + offs_m, mask=offs_m < len_q, other=float("inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA + b * slb + h * slh + start + offs_m, mask=offs_m < len_q, other=0.0)
    K += b * skb + (h // groups) * skh + start * sks
    V += b * svb + (h // groups) * svh + start * svs
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    diag = len_k - len_q
    hi = len_k
    unmasked_end = (len_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.maximum(tl.minimum(len_k, (pid_m + 1) * BLOCK_M + diag), 0)
        unmasked_end = tl.minimum(unmasked_end, tl.maximum(pid_m * BLOCK_M + diag + 1, 0) // BLOCK_N * BLOCK_N)
    if (pid_m + 1) * BLOCK_M > len_q:  # the last query block needs the row bound everywhere
        unmasked_end = 0
    for start_n in range(0, unmasked_end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse_log2, delta, K, V, sks, svs, start_n, offs_m, offs_n, offs_d, len_q, len_k,
                       diag, scale_log2, HEAD_DIM, CAUSAL, False)
    for start_n in range(unmasked_end, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse_log2, delta, K, V, sks, svs, start_n, offs_m, offs_n, offs_d, len_q, len_k,
                       diag, scale_log2, HEAD_DIM, CAUSAL, True)
    dq *= scale_log2 / 1.4426950408889634
    tl.store(DQ + b * sdqb + h * sdqh + (start + offs_m)[:, None] * sdqs + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


def attention_backward(q, k, v, out, lse, grad_out, causal: bool, scale: float, geo: AttnGeometry):
    """(dq, dk, dv) for the forward that produced out/lse; grads are contiguous, shaped like q/k/v."""
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    delta = torch.empty_like(lse)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    lse_strides = geo.lse_strides(lse)
    block = 16 if geo.head_dim > 128 else 64
    _delta_kernel[(triton.cdiv(geo.max_q, block), geo.batch * geo.heads_q)](
        out, grad_out, delta, *geo.strides(out), *geo.strides(grad_out), *lse_strides, geo.heads_q, geo.seq_q, geo.cu,
        HEAD_DIM=geo.head_dim, BLOCK_D=geo.block_d, VARLEN=geo.varlen, BLOCK_M=block)
    common = dict(HEAD_DIM=geo.head_dim, BLOCK_D=geo.block_d, CAUSAL=causal, VARLEN=geo.varlen)
    sizes = (geo.seq_q, geo.seq_k, geo.bucket(geo.max_q), geo.bucket(geo.max_k), scale * LOG2E)
    kv_grid = lambda meta: (triton.cdiv(geo.max_k, meta["BLOCK_N"]), geo.batch * geo.heads_kv)  # noqa: E731
    _attn_dkdv_kernel[kv_grid](q, k, v, grad_out, lse, delta, dk, dv, geo.cu, *geo.strides(q), *geo.strides(k),
                               *geo.strides(v), *geo.strides(grad_out), *geo.strides(dk), *geo.strides(dv),
                               *lse_strides, geo.heads_kv, geo.groups, *sizes, **common)
    q_grid = lambda meta: (triton.cdiv(geo.max_q, meta["BLOCK_M"]), geo.batch * geo.heads_q)  # noqa: E731
    _attn_dq_kernel[q_grid](q, k, v, grad_out, lse, delta, dq, geo.cu, *geo.strides(q), *geo.strides(k),
                            *geo.strides(v), *geo.strides(grad_out), *geo.strides(dq), *lse_strides, geo.heads_q,
                            geo.groups, *sizes, **common)
    return dq, dk, dv
