"""FP8 quantisation with current (per-call) or delayed scaling, and the scaled GEMM of two fp8 operands.

    x8, scale = quantize(x, torch.float8_e4m3fn, dim=-1)   # x ~= x8.float() * scale
    y = scaled_mm(a8, scale_a, b8, scale_b, torch.bfloat16)  # (a8 * scale_a) @ (b8 * scale_b)

`dim` is the dimension the amax is taken over, which must be the GEMM's contraction dimension for the
scales to factor out of the sum: dim=-1 of x [M, K] gives one scale per row ([M, 1]; "rowwise"),
dim=0 one per column ([1, K]), dim=None one for the tensor (a 0-d scale; "tensorwise"). The scale
maps the amax to the format's largest value (448 for e4m3, 57344 for e5m2), as torchao's and
Transformer Engine's current scaling do; an all-zero slice gets a tiny amax rather than a zero scale.

`cast(x, dtype, dim, amax, row=, col=)` is quantize in one or two passes over x (Triton on CUDA,
tpflash.kernels.fp8_cast_kernel; quantize itself on CPU), writing x8 in the layouts the GEMM takes
without a copy: row-major, column-major (a contiguous [K, M] seen as [M, K]) or both at once.
`cast_delayed(x, dtype, history)` is the tensor-scaled cast by an amax history's previous entries
(delayed scaling: x read once), which max-es x's amax into the history's current entry as it casts.

`scaled_mm` runs torch._scaled_mm on CUDA (a [M, K] row-major, b [K, N] column-major; rowwise
scales need bf16 output there) and, elsewhere or for shapes it does not take (dims not multiples of
16), the GEMM of the dequantised operands in fp32: the definition the CUDA kernel is tested against.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from . import dispatch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_AMAX_FLOOR = 1e-12  # torchao's EPS: an all-zero slice quantises to zeros with a finite scale


def amax_of(x: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """fp32 max |x| over `dim` (keepdim; None: the whole tensor, 0-d)."""
    xf = x.float().abs()
    return xf.amax() if dim is None else xf.amax(dim=dim, keepdim=True)


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: Optional[int],
             amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8 in `dtype`, fp32 dequantisation scale): the amax over `dim` (keepdim; None: the whole tensor;
    or the given `amax`, e.g. one reduced over ranks) scaled to the format's largest value, values
    clamped into its range."""
    if dtype not in FP8_MAX:
        raise ValueError(f"fp8 dtype {dtype} must be torch.float8_e4m3fn or torch.float8_e5m2")
    xf = x.float()
    amax = amax_of(xf, dim) if amax is None else amax
    quant = FP8_MAX[dtype] / amax.clamp_min(_AMAX_FLOOR)
    x8 = (xf * quant).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x8, quant.reciprocal()


class Fp8Weight(NamedTuple):
    """A weight's e4m3 copy with its tensorwise scale, made by whoever holds the weight (fsdp=zero3 gathers
    the blocks' weights this way: tpflash.parallel.zero3), found by the fp8 layers as the weight's
    `fp8_weight` attribute: under the tensorwise recipe they multiply `row` instead of casting the
    weight. The weights one GEMM stacks (q/k/v, up/gate) share one scale tensor and lie in adjacent rows."""
    row: torch.Tensor  # the weight's shape, e4m3, row-major
    scale: torch.Tensor  # 0-d fp32 dequantisation scale (quantize's), valid while the layer's forward runs


class Fp8Cast(NamedTuple):
    """x in fp8, in the layouts asked for, and its fp32 dequantisation scale (quantize's)."""
    row: Optional[torch.Tensor]  # x's shape, contiguous
    col: Optional[torch.Tensor]  # [M, K] column-major: the .t() of a contiguous [K, M] (2-D x only)
    scale: torch.Tensor  # [*, 1] (dim -1), [1, K] (dim 0 of a 2-D x), 0-d (dim None)


class Fp8Handoff:
    """A GEMM operand cast to fp8 by the kernel that computes it, handed to the GEMM instead of the
    compute-dtype tensor being written and cast after: under delayed scaling the scale is known before
    the tensor is (tpflash.kernels.swiglu writes its output in e4m3 for the down GEMM, and in its
    backward the up/gate GEMM's [d_up | d_gate] in e5m2). history: the operand's amax history ([n]
    fp32, cast_delayed's); dtype: its format; `cast`: an Fp8Cast with both layouts and the 0-d scale,
    set by the producer and taken by the GEMM."""

    def __init__(self, history: torch.Tensor, dtype: torch.dtype):
        self.history, self.dtype = history, dtype
        self.cast: Optional[Fp8Cast] = None

    def take(self) -> Fp8Cast:
        if self.cast is None:
            raise RuntimeError("Fp8Handoff: its producer handed over no fp8 tensor")
        cast, self.cast = self.cast, None
        return cast


def _on_triton(x: torch.Tensor) -> bool:
    return dispatch.pick(x) == "triton" and x.dim() > 0 and x.numel() > 0 and \
        x.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _triton_scaling(x: torch.Tensor, dim: Optional[int], amax: Optional[torch.Tensor]) -> Optional[int]:
    """The fp8_cast_kernel scaling (0 ROWS, 1 COLUMNS, 2 TENSOR) that does quantize(x, _, dim, amax), or
    None where the kernels do not apply (CPU; empty, 0-d or float64 x; a per-slice or non-fp32 given
    amax; other dims)."""
    if not _on_triton(x):
        return None
    if dim is None:  # quantize computes a given amax's quant in its dtype: the kernel does fp32
        return 2 if amax is None or (amax.numel() == 1 and amax.dtype == torch.float32) else None
    dim = dim % x.dim()
    if amax is not None:
        return None
    return 0 if dim == x.dim() - 1 else 1 if dim == 0 and x.dim() == 2 else None


def past_amax(history: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The amax a delayed-scaling cast scales by (0-d fp32): the maximum of an amax history's previous
    entries, history[1:] (history [n]: [0] collects this step's amaxes); an all-zero history (nothing
    recorded yet, or all-zero tensors) gives the format's largest value, a scale of 1. NaN stays."""
    past = history[1:].amax()
    return torch.where(past == 0, torch.full_like(past, FP8_MAX[dtype]), past)


def record_amax(record: torch.Tensor, x: torch.Tensor) -> None:
    """record (1-element fp32) = max(record, max |x|), NaN winning."""
    record.copy_(torch.maximum(record, amax_of(x, None).reshape(record.shape)))


def _check_record(record: Optional[torch.Tensor]) -> None:
    if record is not None and (record.numel() != 1 or record.dtype != torch.float32):
        raise ValueError(f"record must be a 1-element float32 tensor, got {tuple(record.shape)} {record.dtype}")


def cast(x: torch.Tensor, dtype: torch.dtype, dim: Optional[int], amax: Optional[torch.Tensor] = None,
         row: bool = True, col: bool = False, record: Optional[torch.Tensor] = None) -> Fp8Cast:
    """quantize(x, dtype, dim, amax), bit for bit, with x8 written row-major (`row`), column-major
    (`col`, x 2-D) or both from one read. x [*, K] (any dtype; last-dim stride 1 avoids a copy).
    record (dim None only): a 1-element fp32 tensor that max |x| is max-ed into (record_amax), in
    the cast's pass over x on the Triton path (an amax history's current entry: cast_delayed).

    Triton on CUDA for bf16/fp16/fp32 x (fp8_cast_kernel): dim=-1 reads x once; dim=0 (2-D x) and
    dim=None twice (amax, then cast), once with a given 0-d amax. Elsewhere quantize, and a copy for
    the column-major layout."""
    if col and x.dim() != 2:
        raise ValueError(f"cast: a column-major x8 needs a 2-D x, not {tuple(x.shape)}")
    if record is not None and dim is not None:
        raise ValueError(f"cast: record takes the amax of the whole tensor, so dim must be None, not {dim}")
    _check_record(record)
    scale_by = _triton_scaling(x, dim, amax)
    if scale_by is None:
        x8, scale = quantize(x, dtype, dim, amax)
        if record is not None:
            record_amax(record, x)
        return Fp8Cast(x8 if row else None, x8.t().contiguous().t() if col else None, scale)
    given = None if amax is None else amax.reshape(1).float()
    return _triton(x, dtype, scale_by, given, row, col, record=record)


def _triton(x: torch.Tensor, dtype: torch.dtype, scale_by: int, amax: Optional[torch.Tensor], row: bool, col: bool,
            past: bool = False, record: Optional[torch.Tensor] = None) -> Fp8Cast:
    if dtype not in FP8_MAX:
        raise ValueError(f"fp8 dtype {dtype} must be torch.float8_e4m3fn or torch.float8_e5m2")
    from .fp8_cast_kernel import triton_cast
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    x8, x8_col, scale = triton_cast(x2, dtype, scale_by, amax, row, col, past=past, record=record)
    return Fp8Cast(None if x8 is None else x8.view(x.shape), x8_col,
                   scale.view(*x.shape[:-1], 1) if scale_by == 0 else scale)


def cast_delayed(x: torch.Tensor, dtype: torch.dtype, history: torch.Tensor, row: bool = True,
                 col: bool = False) -> Fp8Cast:
    """Delayed scaling: quantize(x, dtype, None, past_amax(history, dtype)) bit for bit, and max |x|
    max-ed into history[0] (record_amax), x read once. history: x's amax history, [n] fp32 (n >= 2),
    history[1:] the previous steps'. Layouts as in cast."""
    if history.dim() != 1 or history.numel() < 2 or history.dtype != torch.float32 or history.stride(0) != 1:
        raise ValueError(f"cast_delayed: history must be a contiguous 1-D float32 tensor of 2 or more entries, "
                         f"got {tuple(history.shape)} {history.dtype}")
    if col and x.dim() != 2:
        raise ValueError(f"cast: a column-major x8 needs a 2-D x, not {tuple(x.shape)}")
    if _triton_scaling(x, None, None) is None:
        return cast(x, dtype, None, past_amax(history, dtype), row, col, record=history[:1])
    from .fp8_cast_kernel import TENSOR
    return _triton(x, dtype, TENSOR, history[1:], row, col, past=True, record=history[:1])


def cast_stacked(tensors: Sequence[torch.Tensor], dtype: torch.dtype, col: bool = False,
                 history: Optional[torch.Tensor] = None, delayed: bool = False) -> Fp8Cast:
    """cast(torch.cat(tensors), dtype, None, col=col) bit for bit: one scale for the row-stack of 2-D
    tensors [n_i, K] (stacked weights: q/k/v, up/gate), x8 [sum n_i, K] row-major and, with `col`,
    column-major too. history: the stack's amax history ([n] fp32, as cast_delayed's), whose entry [0]
    the stack's amax is max-ed into; with `delayed`, the scale is past_amax(history) (cast_delayed).

    On CUDA no stacked copy in the tensors' dtype is made: each tensor's partial maxima are taken
    (not under `delayed`), then each is cast, with the maximum of all of them, into its rows of the
    stacked fp8 buffers (the column-major one: columns of a contiguous [K, sum n_i]). Elsewhere the
    stack is cast."""
    if not tensors or any(t.dim() != 2 or t.shape[1] != tensors[0].shape[1] for t in tensors):
        raise ValueError(f"cast_stacked: the tensors must be 2-D with one width, [n_i, K]; got "
                         f"{[tuple(t.shape) for t in tensors]}")
    if delayed and history is None:
        raise ValueError("cast_stacked: delayed scaling needs the stack's amax history")
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]
    record = None if history is None else history[:1]
    if not all(_triton_scaling(t, None, None) == 2 for t in tensors) or dtype not in FP8_MAX:
        if delayed:
            return cast_delayed(_row_stack(tensors), dtype, history, row=True, col=col)
        return cast(_row_stack(tensors), dtype, None, row=True, col=col, record=record)
    from .fp8_cast_kernel import TENSOR, triton_amax, triton_cast
    amax = history[1:] if delayed else torch.cat([triton_amax(t, per_column=False) for t in tensors])
    rows, cols, device = sum(t.shape[0] for t in tensors), tensors[0].shape[1], tensors[0].device
    x8 = torch.empty(rows, cols, device=device, dtype=dtype)
    x8_col = torch.empty(cols, rows, device=device, dtype=dtype).t() if col else None  # [rows, cols], strides (1, rows)
    first = 0
    for t in tensors:  # each call writes the same scale: the maximum over all partials (or past amaxes)
        last = first + t.shape[0]
        _, _, scale = triton_cast(t, dtype, TENSOR, amax, row=True, col=col, out_row=x8[first:last],
                                  out_col=x8_col[first:last] if col else None, past=delayed, record=record)
        first = last
    return Fp8Cast(x8, x8_col, scale)


def column_major(x8: torch.Tensor) -> torch.Tensor:
    """x8 [rows, cols] (fp8, contiguous) stored column-major: the same values with strides (1, rows),
    the layout torch._scaled_mm takes its second operand in. A Triton copy on CUDA, else torch's."""
    if x8.dim() != 2 or not x8.is_contiguous():
        raise ValueError(f"column_major: x8 must be a contiguous 2-D tensor, got {tuple(x8.shape)} with "
                         f"strides {x8.stride()}")
    if x8.numel() == 0 or dispatch.pick(x8) != "triton":
        return x8.t().contiguous().t()
    from .fp8_cast_kernel import triton_column_major
    return triton_column_major(x8)


def _row_stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 max |x| over the whole tensor, 0-d (amax_of(x, None); a Triton reduction on CUDA)."""
    if not _on_triton(x):
        return amax_of(x, None)
    from .fp8_cast_kernel import triton_amax
    x2 = x.reshape(-1, x.shape[-1])
    return triton_amax(x2 if x2.stride(1) == 1 else x2.contiguous(), per_column=False).amax()


FP8_MIN_CAPABILITY = (8, 9)  # fp8 matrix units: Ada (8.9), Hopper (9.0) and newer; Triton's e4m3 casts too


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> Tuple[Tuple[int, int], str]:
    return torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device)


def check_fp8_device(recipe: str, device) -> None:
    """Raise ValueError, naming the GPU and the rule, where `recipe` ("off", "rowwise", "tensorwise")
    cannot run its fp8 GEMMs on `device`: a CUDA GPU older than compute capability 8.9. Other
    devices (CPU) run the emulated GEMM of scaled_mm and pass."""
    device = torch.device(device)
    if recipe == "off" or device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    (major, minor), name = _capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        raise ValueError(f"fp8={recipe!r} needs a GPU with fp8 matrix units (compute capability 8.9 or newer: "
                         f"Ada, Hopper, Blackwell); {device} ({name}) is {major}.{minor}: train with fp8='off'")


def dequantize(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values x8 stands for."""
    return x8.float() * scale


def _cuda_shapes_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    m, k = a.shape
    return a.is_cuda and m % 16 == 0 and k % 16 == 0 and b.shape[1] % 16 == 0


def _row_major(t: torch.Tensor) -> bool:
    """Whether cuBLASLt reads the 2-D t in place as row-major: unit column stride, rows that do not overlap."""
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0])


def scaled_mm(a8: torch.Tensor, scale_a: torch.Tensor, b8: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """(a8 * scale_a) @ (b8 * scale_b) in out_dtype: a8 [M, K], b8 [K, N] fp8 (not both e5m2); scales
    fp32 dequantisation scales, one element each (tensorwise), or scale_a [M, 1] and scale_b [1, N]
    (rowwise along K). fast_accum: cuBLASLt's fast accumulation on CUDA (the tensor cores' partial
    sums are not promoted to fp32 every few K steps; llama-1b's up/gate and down GEMMs 11-17% faster), which
    torchao and torchtitan use for the forward GEMM only; ignored by the emulated GEMM.

    On CUDA torch._scaled_mm gets what cuBLASLt's fp8 GEMM takes on Hopper, whatever the layouts
    given: a8 row-major, b8 column-major (copied where they are not), 16-divisible dims, fp32
    scales, 0-d for tensorwise (as torch tells the two recipes apart: by the scales' element count),
    [M, 1] and [1, N] contiguous for rowwise, whose output is bf16 (converted after)."""
    if a8.dtype == E5M2 and b8.dtype == E5M2:  # cuBLASLt has no e5m2 x e5m2 GEMM: fail alike on every device
        raise ValueError("scaled_mm: torch._scaled_mm cannot multiply two float8_e5m2 operands")
    if not _cuda_shapes_ok(a8, b8):
        return (dequantize(a8, scale_a) @ dequantize(b8, scale_b)).to(out_dtype)
    m, n = a8.shape[0], b8.shape[1]
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1
    if tensorwise:
        scale_a, scale_b = scale_a.float().reshape(()), scale_b.float().reshape(())
    else:
        scale_a, scale_b = scale_a.float().reshape(m, 1).contiguous(), scale_b.float().reshape(1, n).contiguous()
    gemm_dtype = out_dtype if tensorwise else torch.bfloat16  # rowwise-scaled _scaled_mm writes bf16 only
    a8 = a8 if _row_major(a8) else a8.contiguous()
    b8 = b8 if _column_major(b8) else b8.t().contiguous().t()
    out = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=gemm_dtype, use_fast_accum=fast_accum)
    return out.to(out_dtype)
