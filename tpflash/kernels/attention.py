"""Public flash attention: input checks and the choice between the Triton kernel and the reference."""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from . import dispatch
from .reference import attention_reference


_HALF = (torch.float16, torch.bfloat16)
_CUDNN_DECLINED = set()  # (shapes, strides, dtype, device, causal) that cuDNN refused once


def _check_attention_inputs(q, k, v, cu_seqlens, max_seqlen) -> None:
    packed = cu_seqlens is not None
    want = 3 if packed else 4
    layout = "[total, heads, head_dim] (varlen)" if packed else "[batch, seq, heads, head_dim]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {layout}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride {t.stride(-1)})")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q head_dim={q.shape[-1]} != k head_dim={k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"heads_q={q.shape[-2]} is not divisible by heads_kv={k.shape[-2]}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q batch={q.shape[0]} != k batch={k.shape[0]}")
    if packed:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with n_seqs+1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"cu_seqlens dtype {cu_seqlens.dtype} must be torch.int32")
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"varlen q total={q.shape[0]} != k total={k.shape[0]} (one cu_seqlens for both)")
        if max_seqlen is not None and max_seqlen < 1:
            raise ValueError(f"max_seqlen={max_seqlen} must be >= 1")


def _cudnn_sdpa(q, k, v, causal, scale, cu_seqlens, return_lse):
    """Out from torch SDPA's cuDNN backend, or None where it does not apply.

    scripts/bench_kernels.py measured cuDNN at ~1.6-1.9x tpflash's Triton kernel (fwd+bwd, H200,
    docs/performance.md), so "auto" takes it for what it supports here: batched attention (MHA, and
    GQA/MQA through SDPA's enable_gqa, which cuDNN runs without repeating k/v), fp16/bf16, head_dim a
    multiple of 8 up to 128 (gpt-2.7b's 80 included), no lse wanted, and top-left == bottom-right
    causal alignment (seq_q == seq_k). A torch or cuDNN that declines (e.g. GQA on an older cuDNN)
    raises, and the Triton kernel runs instead.
    """
    hd = q.shape[-1]
    if (cu_seqlens is not None or return_lse or q.dtype not in _HALF
            or hd % 8 or hd > 128 or (causal and q.shape[1] != k.shape[1])):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, q.device, causal)
    if key in _CUDNN_DECLINED:  # asked once already: do not pay for the exception on every call
        return None
    gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, scale=scale, **gqa)
    except torch.cuda.OutOfMemoryError:  # not a decline: the caller must see it
        raise
    except RuntimeError as exc:  # cuDNN declined this configuration (version, strides, GPU)
        _CUDNN_DECLINED.add(key)
        warnings.warn(f"tpflash attention: cuDNN declined q {tuple(q.shape)}, k {tuple(k.shape)} {q.dtype} "
                      f"(causal={causal}): the Triton kernel runs instead ({str(exc).splitlines()[0][:100]})")
        return None
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens: Optional[torch.Tensor] = None,
                    max_seqlen: Optional[int] = None, return_lse: bool = False):
    """Exact attention softmax(q k^T * softmax_scale) v without materialising the scores.

    q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k, heads_kv, head_dim], any strides with a
    contiguous last dim; heads_q % heads_kv == 0 (GQA/MQA: q head h reads kv head h // (heads_q/heads_kv),
    kv is never repeated in memory). causal: query i sees keys j <= i + seq_k - seq_q (bottom-right,
    as flash-attn). softmax_scale defaults to 1/sqrt(head_dim).
    Varlen (packed sequences): q/k/v [total, heads, head_dim] and cu_seqlens int32 [n_seqs + 1]
    (offsets of each sequence, the same for q and k); max_seqlen = the longest sequence (computed
    when omitted, at the cost of a device sync).
    Backends: Triton on CUDA, the reference on CPU; under "auto", batched attention (MHA or GQA) in
    fp16/bf16 at head_dim a multiple of 8 up to 128 (without return_lse) goes to torch SDPA's cuDNN
    backend where it accepts the call, which measured faster (see docs/performance.md);
    use_backend("triton") forces the Triton kernel.
    Returns out shaped like q (its dtype; contiguous for the Triton kernel), and with return_lse also the fp32 log-sum-exp of
    the scaled scores, [batch, heads_q, seq_q] (varlen: [heads_q, total]). Differentiable in q, k, v.
    """
    _check_attention_inputs(q, k, v, cu_seqlens, max_seqlen)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backend = dispatch.pick(q)
    if backend == "triton" and dispatch.requested_backend() == "auto":
        out = _cudnn_sdpa(q, k, v, causal, scale, cu_seqlens, return_lse)
        if out is not None:
            return out
    if backend == "triton":
        from .flash_attn import triton_flash_attention
        out, lse = triton_flash_attention(q, k, v, causal, scale, cu_seqlens, max_seqlen)
        return (out, lse) if return_lse else out
    return attention_reference(q, k, v, causal, scale, cu_seqlens, max_seqlen, return_lse=return_lse)
