"""Linear layers with their three GEMMs in fp8 (forward, input gradient, weight gradient).

`fp8_linears(x, weights, biases, recipe)` is `autocast_linear.linears` with fp8 GEMMs: the weights
sharing the input x (q/k/v, up/gate) are stacked into one GEMM per direction. Master weights, their
gradients (fp32) and the optimizer are unchanged, and checkpoints hold nothing fp8: rowwise and
tensorwise compute each scale from its operand when it is cast ("current scaling"), and delayed's
amax histories start again on resume, so a bf16 run can resume an fp8 run and the reverse.

Recipes (the GEMM y = x W^T, x [M, K], W [N, K], dY [M, N]):
  tensorwise  one scale per tensor. x and W in e4m3, dY in e5m2 (its wider range, for gradients whose
              magnitudes spread over more octaves than one scale can hold in e4m3): torchao's
              tensorwise recipe and Transformer Engine's "HYBRID" format. The backward reuses the
              forward's fp8 x and W (a tensor scale survives the transpose), so the activation saved
              for backward is the fp8 x: half the bytes of bf16.
  rowwise     one scale per row along each GEMM's contraction dimension, all operands e4m3 (torchao's
              "rowwise" recipe): y from x and W scaled along K; dX = dY W from dY scaled along N and W
              along N (per column); dW = dY^T x from dY and x scaled along M. Finer scales follow
              outlier tokens and channels that one tensor scale would crush; the backward re-casts x
              and W along other axes, so the bf16 x is saved.
  delayed     tensorwise's formats and GEMMs, each scale from the amaxes its tensor had in the previous
              steps (tpflash.layers.fp8_history: Transformer Engine's delayed scaling), so each cast
              reads its tensor once, recording the amax as it goes, and the MLP's SwiGLU backward
              writes the up/gate GEMM's gradient in e5m2 itself (Fp8Amaxes.grad_fp8). A tensor whose
              amax grew past its history's saturates at the format's largest value.

Under tensor parallelism each rank quantises the operands it multiplies (its weight shard, its
part of the input features): scales are per shard, so tp=N differs from tp=1 by fp8 rounding, not
by a scheme. Under sequence parallelism the input is cast before the all-gather, which then moves
fp8 (`_cast_input`); the one collective this adds is the tensorwise amax's reduction over tp (none
under delayed, whose histories are reduced over tp once a step). The
casts are tpflash.kernels.fp8.cast (fused Triton kernels on CUDA, quantize elsewhere), which write
each fp8 operand in the layout its GEMM takes it in: row-major first operands, column-major second
ones (torch._scaled_mm's), so that no GEMM copies one; tensorwise writes x in both layouts from one
read, casts stacked weights into one fp8 buffer without stacking them in fp32 (cast_stacked), and
saves the column-major x and W for the backward. Weights that carry their e4m3 copy
(`kernels.fp8.Fp8Weight`: fsdp=zero3 gathers them so) are not cast under tensorwise: the GEMMs
multiply the copy, and the backward's column-major W is its transpose. The GEMM itself is
tpflash.kernels.fp8.scaled_mm (torch._scaled_mm on CUDA, the dequantised GEMM elsewhere); the forward
GEMM uses cuBLASLt's fast accumulation, the gradients' GEMMs full accumulation, as torchao's and
torchtitan's float8 do.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels import column_sum
from ..kernels.column_sum import concat_rows
from ..kernels.fp8 import (E4M3, E5M2, Fp8Cast, Fp8Handoff, Fp8Weight, cast, cast_delayed, cast_stacked,
                           check_fp8_device, column_major, scaled_mm, tensor_amax)
from ..parallel import comm
from .fp8_history import GemmHistory
from .weight_casts import adjacent_rows

FP8_RECIPES = ("off", "rowwise", "tensorwise", "delayed")
TENSOR_SCALED = ("tensorwise", "delayed")  # one scale per tensor: e4m3 x and W, e5m2 dY, fp8 x and W saved


def check_fp8_recipe(recipe: str) -> None:
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8={recipe!r} must be one of {FP8_RECIPES}")


def _stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


class _Gather(NamedTuple):
    """Sequence parallelism: the input is this rank's [seq/tp, ...] tokens, gathered along seq_dim over group."""
    group: dist.ProcessGroup
    seq_dim: int


class Fp8Amaxes(NamedTuple):
    """Where a tensor-scaled fp8 linear's casts find their amaxes besides the tensors themselves.
    tensorwise: `input`, x's amax (0-d fp32; under SP this rank's tokens'), from x's producer; `grad`,
    a 0-d fp32 tensor that holds the amax of the outputs' gradient [M, sum out_i] by the time the
    backward runs (the consumer's backward writes it: tpflash.kernels.swiglu); either may be None, and
    then the cast reads its tensor once more for it. delayed: `history`, the GEMM's amax histories
    (tpflash.layers.fp8_history; required); while it is delayed, `input_fp8`, x already cast by its
    producer (kernels.fp8.Fp8Handoff; x's values are then not read: it only carries x's gradient),
    and `grad_fp8`, where the consumer's backward hands over the outputs' gradient already cast (a GEMM
    without biases)."""
    input: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None
    history: Optional[GemmHistory] = None
    input_fp8: Optional[Fp8Handoff] = None
    grad_fp8: Optional[Fp8Handoff] = None


def _tensor_cast(t: torch.Tensor, fmt: torch.dtype, history: Optional[torch.Tensor], delayed: bool,
                 amax: Optional[torch.Tensor] = None, row: bool = True, col: bool = False) -> Fp8Cast:
    """t cast with one scale: with `delayed`, the one its amax history gives (cast_delayed), else its
    own amax (given, or taken from t), recorded into the history where there is one (the first,
    priming forward of a delayed-scaling model)."""
    if delayed:
        return cast_delayed(t, fmt, history, row, col)
    return cast(t, fmt, None, amax, row, col, record=None if history is None else history[:1])


def _cast_input(x: torch.Tensor, recipe: str, sp: Optional[_Gather], amax: Optional[torch.Tensor] = None,
                history: Optional[torch.Tensor] = None, delayed: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8 [M, K] of the whole input, row-major; its scale: [M, 1] rowwise, 0-d otherwise). Under
    sequence parallelism this rank's tokens are cast and the fp8 bytes gathered with their scales
    (half the bytes of a bf16 gather), equal bit for bit to gathering x and casting after: rowwise
    scales are per token, the tensorwise amax is reduced over the group first, and delayed scales
    come from histories the group shares. amax: x's, given (tensorwise). history: x's amax history
    (it records x's amax); delayed: scale x by it."""
    rowwise = recipe == "rowwise"
    if rowwise:
        x8, _, scale = cast(x, E4M3, -1)  # [seq/tp, ..., 1] scales travel with their tokens
        if sp is not None:
            scale = comm.all_gather(scale, sp.seq_dim, sp.group)
    else:
        if sp is not None and not delayed:
            amax = tensor_amax(x) if amax is None else amax.clone()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=sp.group)
        x8, _, scale = _tensor_cast(x, E4M3, history, delayed, amax)
    if sp is not None:  # as bytes: not every backend moves fp8 dtypes
        x8 = comm.all_gather(x8.view(torch.uint8), sp.seq_dim, sp.group).view(x8.dtype)
    return x8.reshape(-1, x8.shape[-1]), scale.reshape(-1, 1) if rowwise else scale


def _given_fp8_weights(weights: Sequence[torch.Tensor]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(W8 [N, K] row-major, its 0-d scale) where the weights carry their e4m3 copies (kernels.fp8.Fp8Weight,
    as fsdp=zero3 gathers them), else None. All or none must: the holder of such weights fills no
    other copy of them."""
    given: List[Optional[Fp8Weight]] = [getattr(w, "fp8_weight", None) for w in weights]
    if all(g is None for g in given):
        return None
    scales = {g.scale.data_ptr() for g in given if g is not None}
    if any(g is None for g in given) or len(scales) != 1:
        raise RuntimeError("fp8 tensorwise: the weights of one GEMM must all carry their fp8 copies with one "
                           f"scale (kernels.fp8.Fp8Weight); got {sum(g is not None for g in given)} of {len(given)} "
                           f"with {len(scales)} scale(s)")
    rows = [g.row for g in given]
    w8 = rows[0] if len(rows) == 1 else adjacent_rows(rows, E4M3)
    return (torch.cat(rows) if w8 is None else w8), given[0].scale


_PARAMS = 6  # _Fp8Linear.apply's arguments before the weights and biases


class _Fp8Linear(torch.autograd.Function):
    """[x W_i^T + b_i] with fp8 GEMMs (module docstring): x [*, in] (under `sp`, this rank's tokens of
    it), W_i [out_i, in] -> y_i [*, out_i] (the whole sequence) in `out_dtype`; gradients: x's dtype
    for x (reduce-scattered under `sp`), the parameters' dtypes (fp32 accumulation) for W, b."""

    @staticmethod
    def forward(ctx, x, recipe, out_dtype, sp, amaxes, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.recipe, ctx.sp, ctx.out_dtype, ctx.device = recipe, sp, out_dtype, x.device
        ctx.grad_amax = amaxes.grad  # an attribute: filled by the consumer's backward before this one runs
        # delayed: decided once per forward, so that a recomputed forward and the backward cast alike
        history, delayed = amaxes.history, amaxes.history is not None and amaxes.history.delayed
        hx, hw, ctx.history_dy = (None, None, None) if history is None else (history.x, history.w, history.dy)
        ctx.delayed, ctx.grad_fp8 = delayed, amaxes.grad_fp8 if delayed else None
        if ctx.grad_fp8 is not None and biases[0] is not None:
            raise ValueError("fp8 delayed: a gradient handed over in fp8 (grad_fp8) leaves no bias gradient; "
                             "the GEMM must have no biases")
        ctx.set_materialize_grads(False)  # a None output gradient costs no zeros unless the backward needs them
        ctx.sizes = [w.shape[0] for w in weights]
        ctx.param_dtypes = [None if p is None else p.dtype for p in params]
        ctx.full_shape = x.shape if sp is None else \
            x.shape[:sp.seq_dim] + (x.shape[sp.seq_dim] * sp.group.size(),) + x.shape[sp.seq_dim + 1:]
        tensorwise = recipe in TENSOR_SCALED
        want_dx, want_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[_PARAMS:_PARAMS + n])
        if delayed and amaxes.input_fp8 is not None and sp is None:  # cast by x's producer, both layouts
            x8, x8_saved, sx = amaxes.input_fp8.take()
        elif tensorwise and want_dw and sp is None:  # both layouts from one read: the column-major one for dW
            x8, x8_saved, sx = _tensor_cast(x.reshape(-1, x.shape[-1]), E4M3, hx, delayed, amaxes.input, col=True)
        else:
            x8, sx = _cast_input(x, recipe, sp, amaxes.input, hx, delayed)  # [M, K]
            x8_saved = x8  # under sp row-major: scaled_mm copies it for dW
        given = _given_fp8_weights(weights) if recipe == "tensorwise" else None
        if given is not None:  # cast by their holder: the backward's column-major copy is one transpose
            w8, sw = given
            w8_col, sw = (column_major(w8) if want_dx else None), sw.clone()  # the holder reuses its scale
        elif tensorwise:  # [N, K] stacked in fp8, not in the weights' fp32
            w8, w8_col, sw = cast_stacked(weights, E4M3, col=want_dx, history=hw, delayed=delayed)
        else:
            w = _stack(weights)  # [N, K], saved: the backward casts it per column
            w8, _, sw = cast(w, E4M3, -1)
        y = scaled_mm(x8, sx, w8.t(), sw.t(), out_dtype, fast_accum=True)  # [M, N]
        if biases[0] is not None:
            y = y + _stack(biases).to(out_dtype)
        if tensorwise:  # the fp8 x (half the bytes of the bf16 one) and W, column-major for the backward's GEMMs
            ctx.save_for_backward(x8_saved, sx, w8_col, sw)
        else:
            ctx.save_for_backward(x, w)  # re-cast along other axes in backward (under sp, this rank's tokens)
        return tuple(y.view(*ctx.full_shape[:-1], -1).split(ctx.sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grad_ys):
        n, sp = len(ctx.sizes), ctx.sp
        m = ctx.full_shape[:-1].numel()
        dy = None  # [M, N]; none where the consumer handed it over in fp8
        if ctx.grad_fp8 is None:
            grads = [torch.zeros(m, size, dtype=ctx.out_dtype, device=ctx.device) if g is None else g.reshape(m, size)
                     for g, size in zip(grad_ys, ctx.sizes)]
            dy = grads[0] if n == 1 else concat_rows(grads)  # no copy where they are one buffer's blocks
        want_dx, want_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[_PARAMS:_PARAMS + n])
        dx = dw = None
        if ctx.recipe in TENSOR_SCALED:
            x8, sx, w8, sw = ctx.saved_tensors  # [M, K], [N, K] column-major (under sp x8 row-major: copied)
            if ctx.grad_fp8 is not None:  # [M, N] e5m2 in both layouts, from the consumer's backward
                dy8, dy8_col, sdy = ctx.grad_fp8.take()
            else:
                dy8, dy8_col, sdy = _tensor_cast(dy, E5M2, ctx.history_dy, ctx.delayed, ctx.grad_amax, want_dx, want_dw)
            dx = scaled_mm(dy8, sdy, w8, sw, ctx.out_dtype) if want_dx else None
            dw = scaled_mm(dy8_col.t(), sdy, x8, sx, torch.float32) if want_dw else None
        else:
            x, w = ctx.saved_tensors
            if want_dx:
                dy8, _, sdy = cast(dy, E4M3, -1)  # along N, dX's contraction
                _, wc8, swc = cast(w, E4M3, 0, row=False, col=True)  # [N, K] column-major, a scale per column
                dx = scaled_mm(dy8, sdy, wc8, swc, ctx.out_dtype)
            if want_dw:
                x_full = x if sp is None else comm.all_gather(x, sp.seq_dim, sp.group)
                _, dyc8, sdyc = cast(dy, E4M3, 0, row=False, col=True)  # [M, N] along M, dW's contraction
                _, xc8, sxc = cast(x_full.reshape(m, -1), E4M3, 0, row=False, col=True)  # column-major: dyc8.t()
                dw = scaled_mm(dyc8.t(), sdyc.t(), xc8, sxc, torch.float32)  # is row-major, xc8 column-major
        grad_params: List[Optional[torch.Tensor]] = [None] * (2 * n)
        if dw is not None:
            grad_params[:n] = dw.split(ctx.sizes)
        if ctx.param_dtypes[n] is not None and any(ctx.needs_input_grad[_PARAMS + n:]):
            grad_params[n:] = column_sum(dy).split(ctx.sizes)
        grad_params = [None if g is None else g.to(dt) for g, dt in zip(grad_params, ctx.param_dtypes)]
        if dx is not None:
            dx = dx.view(ctx.full_shape)
            if sp is not None:
                dx = comm.reduce_scatter(dx, sp.seq_dim, sp.group)
        return (dx,) + (None,) * (_PARAMS - 1) + tuple(grad_params)


def fp8_linears(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                recipe: str, sequence_parallel_group: Optional[dist.ProcessGroup] = None,
                seq_dim: int = 0, amaxes: Optional[Fp8Amaxes] = None) -> List[torch.Tensor]:
    """[x W_i^T + b_i] with fp8 GEMMs under `recipe` ("rowwise", "tensorwise" or "delayed"): x [*, in],
    W_i [out_i, in] -> [*, out_i] each, in the autocast dtype under autocast, else x's dtype (x is cast
    to it first, as F.linear under autocast would). Biases: all present or all None.
    sequence_parallel_group: x is this rank's [seq/tp, ...] tokens; they are cast to fp8 and
    all-gathered along `seq_dim` (x's gradient reduce-scattered), and the outputs hold the whole
    sequence. amaxes (Fp8Amaxes): tensorwise, the amaxes the neighbouring kernels give (the input's is
    used only where x is in the compute dtype already: a converted x has other values); delayed, the
    GEMM's amax histories, required; rowwise ignores them."""
    if recipe not in FP8_RECIPES[1:]:
        raise ValueError(f"fp8_linears: recipe {recipe!r} must be one of {FP8_RECIPES[1:]}")
    if recipe == "delayed" and (amaxes is None or amaxes.history is None):
        raise ValueError("fp8_linears: fp8='delayed' needs the GEMM's amax histories (Fp8Amaxes(history=...)): "
                         "build the layers inside a tpflash GPT, or give them histories with "
                         "tpflash.layers.fp8_history.AmaxHistory and call its advance() at every training forward")
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("fp8_linears: biases must be all present or all None")
    check_fp8_device(recipe, x.device)
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    sp = None
    if sequence_parallel_group is not None and sequence_parallel_group.size() > 1:
        sp = _Gather(sequence_parallel_group, seq_dim % x.dim())
    if recipe == "delayed":  # the casts take their amaxes from the histories
        amaxes = Fp8Amaxes(history=amaxes.history, input_fp8=amaxes.input_fp8, grad_fp8=amaxes.grad_fp8)
        if amaxes.input_fp8 is not None and (x.dtype != out_dtype or sequence_parallel_group is not None):
            raise ValueError(f"fp8_linears: an input cast by its producer (input_fp8) must come in the compute dtype "
                             f"({out_dtype}, not {x.dtype}) and not be gathered over a sequence-parallel group")
    elif recipe == "tensorwise" and amaxes is not None:
        amaxes = amaxes._replace(history=None, input_fp8=None, grad_fp8=None)
    else:
        amaxes = Fp8Amaxes()
    if x.dtype != out_dtype:
        amaxes = amaxes._replace(input=None)
    with torch.autocast(device, enabled=False):
        x = x.to(out_dtype)
        return list(_Fp8Linear.apply(x, recipe, out_dtype, sp, amaxes, len(weights), *weights, *biases))
