"""Sequence-parallel GEMMs over PyTorch's symmetric-memory collective matmuls ("async TP").

The second overlap backend (`TPFLASH_OVERLAP_BACKEND=symm_mem`, CUDA only). Instead of NCCL
kernels running beside the GEMMs (tpflash.parallel.overlap's pieces, which compete with them for
SMs), `torch.ops.symm_mem.fused_all_gather_matmul` copies each peer's shard straight out of its
symmetric buffer with the copy engines while the GEMM on the shards already here runs, and
`fused_matmul_reduce_scatter` writes each destination's partial product into its peer's buffer as
soon as it is computed. This is the mechanism torchtitan enables as async tensor parallelism.

Both autograd Functions map the four SP collectives of a column -> row pair onto those two ops:

  column  forward  ys_i = all_gather(x) @ W_i^T      fused_all_gather_matmul (x_full kept)
          backward grad_x = reduce_scatter(sum_i grad_y_i W_i)  fused_matmul_reduce_scatter
  row     forward  y = reduce_scatter(h @ W^T)       fused_matmul_reduce_scatter
          backward grad_h = all_gather(grad_y) @ W   fused_all_gather_matmul (grad_y_full kept)

and compute the weight gradients from the gathered tensors the ops return. Activations are
sequence-first, gathered/scattered along dim 0. Process group: the tp group passed in.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Sequence

import torch

from ..layers.weight_casts import stacked_cast
from .overlap import _cast, linear_compute_dtype, _no_autocast, _rows

_enabled_groups: set = set()


def available(x: torch.Tensor) -> bool:
    """Whether the symmetric-memory ops can run on x: a CUDA tensor and a torch that has them."""
    ops = getattr(torch.ops, "symm_mem", None)
    return x.is_cuda and ops is not None and hasattr(ops, "fused_all_gather_matmul")


def _group_name(group) -> str:
    """The group's name for the symm_mem ops, registering the group on first use (torch 2.11 needs
    `enable_symm_mem_for_group`; later versions deprecate it as unnecessary)."""
    name = group.group_name
    if name not in _enabled_groups:
        from torch.distributed import _symmetric_memory as symm
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        _enabled_groups.add(name)
    return name


class _SymmAllGatherLinear(torch.autograd.Function):
    """ys_i = all_gather_seq(x_local) @ W_i^T + b_i; x_local [s/tp, b, in] -> ys_i [s, b, out_i/tp]."""

    @staticmethod
    def forward(ctx, x_local, group, *params):
        n = len(params) // 2
        dtype = linear_compute_dtype(x_local)
        ctx.group, ctx.x_dtype = group, x_local.dtype
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.has_bias = [b is not None for b in params[n:]]
        x = x_local.to(dtype).contiguous()
        weights, biases = [stacked_cast([w], dtype) for w in params[:n]], [_cast(b, dtype) for b in params[n:]]
        with _no_autocast(x):
            x_full, outs = torch.ops.symm_mem.fused_all_gather_matmul(
                x, [w.t() for w in weights], 0, _group_name(group), return_A=True)  # [s, b, in], [s, b, out_i/tp]
            outs = [o if b is None else o.add_(b) for o, b in zip(outs, biases)]
        ctx.save_for_backward(x_full, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_ys):
        x_full, *weights = ctx.saved_tensors
        grads = [g.to(x_full.dtype).contiguous() for g in grad_ys]  # [s, b, out_i/tp]
        # one fused GEMM + reduce-scatter for all weights: sum_i g_i W_i == [g_1 .. g_n] @ [W_1; ..; W_n]
        g_cat = grads[0] if len(grads) == 1 else torch.cat(grads, -1)
        w_cat = weights[0] if len(weights) == 1 else torch.cat(weights, 0)
        with _no_autocast(x_full):
            grad_x = torch.ops.symm_mem.fused_matmul_reduce_scatter(g_cat, w_cat, "sum", 0,
                                                                    _group_name(ctx.group))  # [s/tp, b, in]
            x_rows = _rows(x_full)
            grad_ws = [_rows(g).t() @ x_rows for g in grads]
            grad_bs = [_rows(g).sum(0) if has else None for g, has in zip(grads, ctx.has_bias)]
        param_grads = [None if g is None else g.to(dt) for g, dt in zip(grad_ws + grad_bs, ctx.param_dtypes)]
        return (grad_x.to(ctx.x_dtype), None, *param_grads)


class _SymmLinearReduceScatter(torch.autograd.Function):
    """y_local = reduce_scatter_seq(h @ W^T): h [s, b, in/tp] -> y_local [s/tp, b, out]."""

    @staticmethod
    def forward(ctx, h, weight, group):
        dtype = linear_compute_dtype(h)
        ctx.group, ctx.dtypes = group, (h.dtype, weight.dtype)
        h, w = h.to(dtype).contiguous(), stacked_cast([weight], dtype)
        with _no_autocast(h):
            y = torch.ops.symm_mem.fused_matmul_reduce_scatter(h, w.t(), "sum", 0, _group_name(group))
        ctx.save_for_backward(h, w)
        return y  # [s/tp, b, out]

    @staticmethod
    def backward(ctx, grad_y):
        h, w = ctx.saved_tensors
        grad_y = grad_y.to(h.dtype).contiguous()  # [s/tp, b, out]
        with _no_autocast(h):
            grad_full, (grad_h,) = torch.ops.symm_mem.fused_all_gather_matmul(
                grad_y, [w], 0, _group_name(ctx.group), return_A=True)  # [s, b, out], [s, b, in/tp]
            grad_w = _rows(grad_full).t() @ _rows(h)  # [out, in/tp]
        return grad_h.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


def all_gather_linear(x_local: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Sequence[Optional[torch.Tensor]], group) -> List[torch.Tensor]:
    """[F.linear(all_gather_along_seq(x_local), W_i, b_i)] through fused_all_gather_matmul (see module doc).
    x_local [s/tp, b, in] on CUDA, W_i [out_i/tp, in] -> [s, b, out_i/tp] each. The gathered input is
    kept for the backward (there is no re-gathering variant here)."""
    return list(_SymmAllGatherLinear.apply(x_local, group, *weights, *biases))


def linear_reduce_scatter(h: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """reduce_scatter_along_seq(F.linear(h, weight)) through fused_matmul_reduce_scatter.
    h [s, b, in/tp] on CUDA with s divisible by tp (tpflash.parallel.overlap.linear_reduce_scatter,
    the entry point, checks it), weight [out, in/tp] -> [s/tp, b, out]."""
    return _SymmLinearReduceScatter.apply(h, weight, group)
