"""Public rotary position embedding: checks and dispatch."""
from __future__ import annotations

import torch

from . import dispatch
from .reference import rotary_reference


def _check_rotary_inputs(x, cos, sin) -> None:
    if x.dim() < 3:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., seq, heads, head_dim]")
    if x.stride(-1) != 1:
        raise ValueError(f"x must have a contiguous last dim (stride {x.stride(-1)})")
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [seq, rotary_dim/2]")
    seq, half = cos.shape
    if seq != x.shape[-3]:
        raise ValueError(f"cos/sin cover seq={seq} positions but x has seq={x.shape[-3]} (shape {tuple(x.shape)})")
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary_dim={2 * half} exceeds head_dim={x.shape[-1]}")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 inplace: bool = False) -> torch.Tensor:
    """Rotary embedding of x [..., seq, heads, head_dim] (any strides, contiguous last dim).

    cos/sin [seq, rotary_dim/2] (fp32 recommended): the first rotary_dim features are rotated in
    pairs (i, i + rotary_dim/2) (GPT-NeoX/Llama) or, with interleaved=True, (2i, 2i+1) (GPT-J);
    the rest pass through. Varlen inputs [total, heads, head_dim] take cos/sin gathered per token
    ([total, rotary_dim/2]). inplace=True writes into x and returns it (autograd-safe: x is
    marked dirty). Differentiable in x (cos/sin get no gradient).
    """
    _check_rotary_inputs(x, cos, sin)
    if dispatch.pick(x) == "triton":
        from .rotary_kernels import triton_rotary
        return triton_rotary(x, cos, sin, interleaved, inplace)
    out = rotary_reference(x, cos, sin, interleaved)
    return x.copy_(out) if inplace else out
