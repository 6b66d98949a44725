"""Cross-entropy of hidden @ weight.T without materialising the [tokens, vocab] logits.

Tokens are processed in chunks: per chunk the logits shard [chunk, V/tp] is computed, its loss
statistics combined over tp (tpflash.losses.cross_entropy.ShardLoss), and, for "mean"/"sum",
the gradient is formed right away in the chunk's logits buffer and folded into d hidden and
d weight (3 GEMMs per chunk, as the unfused forward + backward) so the backward only scales
them. For "none" the per-token upstream gradient is unknown in the forward, so the backward
recomputes each chunk's logits (one extra GEMM).

Under sequence parallelism hidden is gathered along the sequence first, and d hidden is
reduce-scattered back. Where d hidden is formed in the forward, its reduce-scatter is issued there,
as soon as the last chunk's d hidden GEMM is done, and travels beside that chunk's d weight GEMM
(on the copy engines where they reach the group: an NCCL kernel would wait for the GEMM's SMs):
the backward then only scales this rank's part.

The GEMMs run in autocast's dtype under autocast (else in hidden's dtype), on a copy of the weight
cast inside, as F.linear's would; d weight is written in fp32 by the GEMMs and summed over the
chunks in fp32 (tpflash.kernels.weight_grad_fp32), then returned in the weight's dtype: no bf16
rounding per chunk, and no separate cast of a bf16 gradient to the fp32 parameter afterwards.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.weight_grad import weight_grad_fp32
from ..parallel import comm
from ..parallel.state import group_size, resolve_tp_group
from .cross_entropy import ShardLoss, check_loss_args, check_vocab, reduce_loss


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's where it is on for hidden's device (as F.linear's), else hidden's."""
    device = hidden.device.type
    if hidden.is_floating_point() and device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def _chunks(n: int, size: int):
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """loss(hidden @ weight.T); hidden is `full`, or under sequence parallelism (`scatter` = (group,
    seq_dim)) `full` is `local` gathered along seq_dim and d local is d full reduce-scattered."""

    @staticmethod
    def forward(ctx, full, local, weight, target, group, ignore_index, reduction, chunk_size, vocab_size,
                label_smoothing, z_loss, needs_grad, scatter):
        hidden = full if local is None else local
        ctx.dtypes = (hidden.dtype, weight.dtype)
        with torch.autocast(full.device.type, enabled=False):
            h2, w = full.reshape(-1, full.shape[-1]), weight.to(full.dtype)  # [N, H], [V/tp, H]
            t = target.reshape(-1)  # [N]
            loss_args = (group, ignore_index, label_smoothing, z_loss, vocab_size)
            losses = torch.empty(t.shape[0], device=full.device, dtype=torch.float32)
            precompute = needs_grad and reduction != "none"
            if precompute:
                count = (t != ignore_index).sum().clamp_min(1) if reduction == "mean" else None
                grad_h, grad_w = torch.empty_like(h2), None  # grad_w: fp32 [V/tp, H], summed over chunks
            chunks, scattered = _chunks(t.shape[0], chunk_size), None
            for i, rows in enumerate(chunks):
                logits = h2[rows] @ w.t()  # [chunk, V/tp]
                shard = ShardLoss(logits, t[rows], *loss_args)
                losses[rows] = shard.loss
                if precompute:
                    row_scale = torch.ones_like(shard.loss) if count is None else torch.ones_like(shard.loss) / count
                    g = shard.logits_grad(logits, row_scale, out=logits)  # the logits buffer becomes the gradient
                    torch.matmul(g, w, out=grad_h[rows])
                    if scatter is not None and i == len(chunks) - 1:  # d hidden is whole: it travels now
                        scattered = comm.reduce_scatter_async(grad_h.view(full.shape), scatter[1], scatter[0],
                                                              beside_compute=True)
                    grad_w = weight_grad_fp32(g, h2[rows], into=grad_w)
            if precompute and scatter is not None:
                grad_h = (scattered or comm.reduce_scatter_async(grad_h.view(full.shape), scatter[1],
                                                                 scatter[0])).wait()  # [.., seq/tp, .., H]
        ctx.args = (loss_args, chunk_size, reduction, precompute, hidden.shape, full.shape, scatter)
        if precompute:
            ctx.save_for_backward(grad_h, grad_w)
        elif needs_grad:
            ctx.save_for_backward(h2, w, t)
        return reduce_loss(losses, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        loss_args, chunk_size, reduction, precompute, shape, full_shape, scatter = ctx.args
        h_dtype, w_dtype = ctx.dtypes
        if precompute:
            grad_h, grad_w = ctx.saved_tensors
            grad_h, grad_w = grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.float()
        else:
            h2, w, t = ctx.saved_tensors
            grad_out = grad_out.reshape(-1).float()
            grad_h, grad_w = torch.empty_like(h2), None
            with torch.autocast(h2.device.type, enabled=False):
                for rows in _chunks(t.shape[0], chunk_size):
                    logits = h2[rows] @ w.t()
                    shard = ShardLoss(logits, t[rows], *loss_args)
                    g = shard.logits_grad(logits, grad_out[rows], out=logits)
                    torch.matmul(g, w, out=grad_h[rows])
                    grad_w = weight_grad_fp32(g, h2[rows], into=grad_w)
            if scatter is not None:
                grad_h = comm.reduce_scatter(grad_h.view(full_shape), scatter[1], scatter[0])
        grad_h = grad_h.reshape(shape).to(h_dtype)
        grads = (None, grad_h) if scatter is not None else (grad_h, None)
        return *grads, grad_w.to(w_dtype), *([None] * 10)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                               process_group=None, ignore_index: int = -100, reduction: str = "mean",
                               chunk_size: Optional[int] = None, vocab_size: Optional[int] = None, *,
                               label_smoothing: float = 0.0, z_loss: float = 0.0,
                               sequence_parallel: bool = False, seq_dim: int = 0) -> torch.Tensor:
    """F.cross_entropy(hidden @ W.T, target) where W is vocab-sharded over tp, chunked over tokens.

    hidden [*, H], replicated over tp (with sequence_parallel: this rank's sequence shard, gathered
    along `seq_dim` here); weight_shard [V'/tp, H]: rank r holds rows [r*V'/tp, (r+1)*V'/tp) of the
    vocabulary padded to V' (VocabParallelEmbedding's layout; vocab_size = the real V, padding rows
    never count). target [*] (the full sequence) with global ids. chunk_size: tokens per chunk
    (default: about 2^29 / (V'/tp) logits per chunk, rounded to 256). Peak extra memory is one
    [chunk_size, V'/tp] logits buffer plus d weight, instead of [tokens, V'/tp] logits and their
    fp32 copies. label_smoothing / z_loss / reduction as in vocab_parallel_cross_entropy.
    d hidden is summed over tp (replicated input) or reduce-scattered (sequence_parallel).
    Under autocast the GEMMs run in its dtype on cast copies of hidden and weight (an fp32 weight
    gets an fp32 gradient summed in fp32); without autocast hidden's dtype is used.
    Process group: `process_group`, else the default tp group, else none (tp=1).
    """
    check_loss_args(reduction, label_smoothing, z_loss)
    if chunk_size is None:
        chunk_size = max(256, (1 << 29) // max(weight_shard.shape[0], 1) // 256 * 256)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    group = resolve_tp_group(process_group)
    tp = group_size(group)
    if weight_shard.dim() != 2 or weight_shard.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight_shard shape {tuple(weight_shard.shape)} must be [V/tp, hidden={hidden.shape[-1]}]")
    # cast before any gather: the collective then moves the compute dtype's bytes
    hidden = hidden.to(_compute_dtype(hidden))
    scatter = (group, seq_dim) if sequence_parallel and tp > 1 else None
    if scatter is not None:  # gathered here, outside autograd: the Function reduce-scatters d hidden itself
        with torch.no_grad():
            full = comm.all_gather(hidden, seq_dim, group)
        local = hidden
    else:
        full, local = comm.copy_to_tp_region(hidden, group), None
    if full.shape[:-1] != target.shape:
        raise ValueError(f"hidden shape {tuple(full.shape)} (after any sequence gather) does not match target "
                         f"shape {tuple(target.shape)} (expected hidden [*, H] and target [*])")
    check_vocab(vocab_size, weight_shard.shape[0], tp, target, ignore_index)
    requires_grad = hidden.requires_grad or weight_shard.requires_grad
    return _FusedLinearCrossEntropy.apply(full, local, weight_shard, target, group, ignore_index, reduction, chunk_size,
                                          vocab_size, label_smoothing, z_loss,
                                          torch.is_grad_enabled() and requires_grad, scatter)
