"""Causal attention computed query chunk by query chunk into one output, and its backward over the
whole sequence.

A row-parallel output projection can send each chunk's rows to their rank as soon as they exist
(tpflash.parallel.attention_projection) only if the attention's output comes chunk by chunk. The
sequence is cut into `chunks` equal query chunks; chunk r's queries see the keys of chunks 0..r, the
causal mask aligned bottom-right (query i of the chunk sees keys up to r*size + i). The Triton
forward kernel takes that alignment and any strides: each chunk is one launch reading q, k and v
where the q/k/v projection left them and writing its rows of the output ([s, b, heads, d],
seq-first: the projection's input as it is) and of the log-sum-exp. The backward runs once over the
whole sequence from the assembled output and log-sum-exp: cuDNN's (through torch's
`_scaled_dot_product_cudnn_attention_backward`) where `kernels.flash_attention` would take cuDNN,
else the Triton kernels'. On CPU the reference runs both.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import dispatch
from .attention import _HALF
from .reference import attention_backward_reference, attention_reference

BACKENDS = ("triton", "reference")


def chunked_attention_backend(q: torch.Tensor) -> Optional[str]:
    """The backend chunked attention runs on for q [s, b, heads, head_dim]: "triton" where kernels run
    Triton (CUDA; head_dim up to flash_attn.MAX_HEAD_DIM), "reference" where they run the reference."""
    backend = dispatch.pick(q)
    if backend == "reference":
        return "reference"
    from .flash_attn import MAX_HEAD_DIM
    return "triton" if q.shape[-1] <= MAX_HEAD_DIM else None


class ChunkedCausalAttention:
    """softmax(q k^T * scale, causal) v for q [s, b, hq, d], k/v [s, b, hkv, d] (seq-first, any strides
    with a contiguous last dim; GQA: q head h reads kv head h // (hq/hkv)), computed by `chunks` query
    chunks of s/chunks positions (module docstring). `rows(r)` computes chunk r and returns its
    output [s/chunks, b, hq, d], a view of `out` [s, b, hq, d]; once every chunk is computed, `out` and
    `lse` [b, hq, s] (fp32) are the whole attention's, for `causal_attention_backward`.
    backend: `chunked_attention_backend(q)`."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int, scale: float, backend: str):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        s, b, hq, d = q.shape
        if s % chunks:
            raise ValueError(f"sequence length {s} is not divisible into {chunks} query chunks")
        self.q, self.k, self.v = q, k, v
        self.size, self.scale, self.backend = s // chunks, scale, backend
        self.out = torch.empty(s, b, hq, d, device=q.device, dtype=q.dtype)
        self.lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)

    def rows(self, r: int) -> torch.Tensor:
        """Chunk r's output [s/chunks, b, hq, d] (its rows of `out`, and of `lse`, written)."""
        lo, hi = r * self.size, (r + 1) * self.size
        q, k, v, out = (t.transpose(0, 1) for t in (self.q[lo:hi], self.k[:hi], self.v[:hi], self.out[lo:hi]))
        lse = self.lse[:, :, lo:hi]  # [b, hq, size]
        if self.backend == "reference":
            o, l = attention_reference(q, k, v, True, self.scale, return_lse=True)  # bottom-right causal
            out.copy_(o)
            lse.copy_(l)
        else:
            from .flash_attn import AttnGeometry, attention_forward
            attention_forward(q, k, v, True, self.scale, AttnGeometry(q, k, None, None), out=out, lse=lse)
        return self.out[lo:hi]


def _cudnn_backward_runs(q: torch.Tensor) -> bool:
    """Whether the backward takes cuDNN for q [s, b, heads, head_dim]: where `kernels.flash_attention`
    would (kernels "auto", fp16/bf16, head_dim a multiple of 8 up to 128), it being faster."""
    hd = q.shape[-1]
    return (dispatch.requested_backend() == "auto" and q.dtype in _HALF and hd % 8 == 0 and hd <= 128
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward"))


def causal_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, grad_out: torch.Tensor, scale: float,
                              backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of causal attention over the whole sequence from its output and log-sum-exp:
    q/out/grad_out [s, b, hq, d], k/v [s, b, hkv, d] (seq-first), lse [b, hq, s] fp32 (natural log);
    results shaped like q, k, v. backend: the forward's."""
    as_api = [t.transpose(0, 1) for t in (q, k, v, out, grad_out)]  # [b, s, h, d] views
    if backend == "reference":
        grads = attention_backward_reference(*as_api, lse, True, scale)
    elif _cudnn_backward_runs(q):
        qh, kh, vh, oh, gh = (t.transpose(1, 2) for t in as_api)  # [b, h, s, d] views
        s = q.shape[0]
        unused = torch.empty((), dtype=torch.int64, device=q.device)  # the philox seed and offset: no dropout
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            gh, qh, kh, vh, oh, lse.unsqueeze(-1), unused, unused, None, None, None, s, s, 0.0, True, scale=scale)
        grads = [t.transpose(1, 2) for t in grads]
    else:
        from .flash_attn import AttnGeometry
        from .flash_attn_bwd import attention_backward
        q_, k_ = as_api[0], as_api[1]
        grads = attention_backward(*as_api[:4], lse, as_api[4], True, scale, AttnGeometry(q_, k_, None, None))
    return tuple(t.transpose(0, 1) for t in grads)
