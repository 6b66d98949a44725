"""Cross-entropy of hidden @ weight.T without materialising the [tokens, vocab] logits.

Tokens are processed in chunks: per chunk the logits shard [chunk, V/tp] is computed, its loss
statistics combined over tp (tpflash.losses.cross_entropy.ShardLoss), and, for "mean"/"sum",
the gradient is formed right away in the chunk's logits buffer and folded into d hidden and
d weight (3 GEMMs per chunk, as the unfused forward + backward) so the backward only scales
them. For "none" the per-token upstream gradient is unknown in the forward, so the backward
recomputes each chunk's logits (one extra GEMM).

Under sequence parallelism hidden is all-gathered along the sequence while the first chunk's logits
are computed: their GEMM runs per rank's rows, this rank's own first (they wait for no transfer),
each peer's once they are here (tpflash.parallel.overlap_transfers: on the copy engines where they
reach the group, else the group's all-gather first). Every rank runs the chunks in one order, since
their loss statistics are combined over tp chunk by chunk, so where one chunk holds fewer than all
the tokens, the ranks whose rows it does not hold wait for the first peer's. d hidden is
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
from ..parallel import overlap_transfers as transfers
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


def _gathered_logits(gather, rows: slice, w: torch.Tensor, per_rank: int) -> torch.Tensor:
    """hidden[rows] @ w.T [len(rows), V/tp] while hidden's all-gather is open: the rows of each rank r
    ([r * per_rank, (r + 1) * per_rank) of the gathered [N, H]) multiplied once r's part is here, this
    rank's own first (they wait for no transfer), then the next ranks' (gather.order())."""
    out = w.new_empty((rows.stop - rows.start, w.shape[0]))
    for r in gather.order():
        lo, hi = max(rows.start, r * per_rank), min(rows.stop, (r + 1) * per_rank)
        if lo < hi:
            torch.mm(gather.piece(r)[lo - r * per_rank:hi - r * per_rank], w.t(),
                     out=out[lo - rows.start:hi - rows.start])
    return out


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """loss(hidden @ weight.T); hidden [*, H] holds every token (replicated over tp), or under sequence
    parallelism (`scatter` = group) this rank's rows [N/tp, H] of the sequence-first tokens: they are
    all-gathered here, and d hidden is reduce-scattered."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, ignore_index, reduction, chunk_size, vocab_size,
                label_smoothing, z_loss, needs_grad, scatter):
        ctx.dtypes = (hidden.dtype, weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            w, local = weight.to(hidden.dtype), hidden.reshape(-1, hidden.shape[-1])  # [V/tp, H], [n, H]
            t = target.reshape(-1)  # [N]
            # under sequence parallelism the peers' rows travel while this rank's own are multiplied
            gather = None if scatter is None else transfers.all_gather(local, scatter)
            h2 = local if gather is None else None  # [N, H] once gathered
            loss_args = (group, ignore_index, label_smoothing, z_loss, vocab_size)
            losses = torch.empty(t.shape[0], device=hidden.device, dtype=torch.float32)
            precompute = needs_grad and reduction != "none"
            if precompute:
                count = (t != ignore_index).sum().clamp_min(1) if reduction == "mean" else None
                grad_h, grad_w = w.new_empty((t.shape[0], w.shape[1])), None  # grad_w: fp32 [V/tp, H], summed
            chunks, scattered = _chunks(t.shape[0], chunk_size), None
            for i, rows in enumerate(chunks):
                if h2 is None:
                    logits = _gathered_logits(gather, rows, w, local.shape[0])  # [chunk, V/tp]
                    h2 = gather.finish()
                else:
                    logits = h2[rows] @ w.t()
                shard = ShardLoss(logits, t[rows], *loss_args)
                losses[rows] = shard.loss
                if precompute:
                    row_scale = torch.ones_like(shard.loss) if count is None else torch.ones_like(shard.loss) / count
                    g = shard.logits_grad(logits, row_scale, out=logits)  # the logits buffer becomes the gradient
                    torch.matmul(g, w, out=grad_h[rows])
                    if scatter is not None and i == len(chunks) - 1:  # d hidden is whole: it travels now
                        scattered = comm.reduce_scatter_async(grad_h, 0, scatter, beside_compute=True)
                    grad_w = weight_grad_fp32(g, h2[rows], into=grad_w)
            if h2 is None:  # no tokens
                h2 = gather.finish()
            if precompute and scatter is not None:
                grad_h = (scattered or comm.reduce_scatter_async(grad_h, 0, scatter)).wait()  # [n, H]
        ctx.args = (loss_args, chunk_size, reduction, precompute, hidden.shape, scatter)
        if precompute:
            ctx.save_for_backward(grad_h, grad_w)
        elif needs_grad:
            ctx.save_for_backward(h2, w, t)
        return reduce_loss(losses, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        loss_args, chunk_size, reduction, precompute, shape, scatter = ctx.args
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
                grad_h = comm.reduce_scatter(grad_h, 0, scatter)
        return grad_h.reshape(shape).to(h_dtype), grad_w.to(w_dtype), *([None] * 10)


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
    scatter = group if sequence_parallel and tp > 1 else None
    if scatter is not None:
        dim = seq_dim % hidden.dim()
        if dim == hidden.dim() - 1:
            raise ValueError(f"seq_dim={seq_dim} names hidden's feature dimension (hidden shape "
                             f"{tuple(hidden.shape)}); the sequence dimension must come before it")
        if dim != 0:  # other layouts run sequence-first: each rank's rows are then one block of the tokens
            loss = fused_linear_cross_entropy(hidden.movedim(dim, 0), weight_shard, target.movedim(dim, 0),
                                              process_group, ignore_index, reduction, chunk_size, vocab_size,
                                              label_smoothing=label_smoothing, z_loss=z_loss, sequence_parallel=True)
            return loss.movedim(0, dim) if reduction == "none" else loss
    full_shape = hidden.shape if scatter is None else (tp * hidden.shape[0],) + hidden.shape[1:]
    if full_shape[:-1] != target.shape:
        raise ValueError(f"hidden shape {tuple(full_shape)} (after any sequence gather) does not match target "
                         f"shape {tuple(target.shape)} (expected hidden [*, H] and target [*])")
    check_vocab(vocab_size, weight_shard.shape[0], tp, target, ignore_index)
    # cast before any gather: the collective then moves the compute dtype's bytes
    hidden = hidden.to(_compute_dtype(hidden))
    requires_grad = hidden.requires_grad or weight_shard.requires_grad
    if scatter is None:  # d hidden summed over tp
        hidden = comm.copy_to_tp_region(hidden, group)
    return _FusedLinearCrossEntropy.apply(hidden, weight_shard, target, group, ignore_index, reduction, chunk_size,
                                          vocab_size, label_smoothing, z_loss,
                                          torch.is_grad_enabled() and requires_grad, scatter)
