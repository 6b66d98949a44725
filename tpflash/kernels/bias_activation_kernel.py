"""Triton act(y + bias) and its backward with the bias gradient's column sum in the same pass.

One kernel, one flag (BACKWARD). Forward: h = act(y + bias), computed in fp32, stored in y's dtype.
Backward: dy = dh * act'(y + bias), stored in dh's dtype, and the fp32 column sums of the stored dy
(the bias gradient) kept in registers: the column sum costs no extra read of dy. The grid and the
deterministic partial sums are column_sum_kernel's (a [splits, cols] fp32 buffer summed by its
`sum_partials`, no atomics); the launch is a fixed rule (LAUNCH), so tp ranks summing the same rows get the same bits.
ACT: 0 GELU with the tanh approximation (GPT-2's "gelu"), 1 exact (erf) GELU, 2 ReLU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .column_sum_kernel import INTERPRET_SMS, _row_split, _sm_count, sum_partials

ACTIVATION_IDS = {"gelu": 0, "gelu_exact": 1, "relu": 2}


# The constants are literals inside the functions: compiled Triton reads no plain Python globals
# (the CPU interpreter would not say so), and constexpr globals do not mix with its tensors.
# sqrt(2/pi) = 0.7978845608028654, 1/sqrt(2) = 0.7071067811865476, 1/sqrt(2 pi) = 0.3989422804014327.

@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:  # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        out = x * tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
    elif ACT == 1:
        out = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    else:
        out = tl.maximum(x, 0.0)
    return out


@triton.jit
def _activation_grad(x, ACT: tl.constexpr):
    if ACT == 0:  # s + x s (1 - s) 2u', with s = sigmoid(2u) (1 - tanh(u)^2 = 4 s (1 - s))
        s = tl.sigmoid(2.0 * 0.7978845608028654 * (x + 0.044715 * x * x * x))
        grad = s + 2.0 * x * s * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    elif ACT == 1:
        grad = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    else:
        grad = tl.where(x > 0.0, 1.0, 0.0)
    return grad


@triton.jit
def _bias_activation_kernel(Y, BIAS, DH, OUT, PARTIALS, rows, cols, stride_y, stride_dh, rows_per_split,
                            ACT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    in_cols = c < cols
    bias = tl.load(BIAS + c, mask=in_cols, other=0.0).to(tl.float32)
    first = split * rows_per_split
    last = tl.minimum(first + rows_per_split, rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for start in tl.range(first, last, BLOCK_R, num_stages=STAGES):
        r = (start + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (r < last)[:, None] & in_cols[None, :]
        pre = tl.load(Y + r[:, None] * stride_y + c[None, :], mask=mask, other=0.0).to(tl.float32) + bias[None, :]
        at = OUT + r[:, None] * cols + c[None, :]
        if BACKWARD:
            dh = tl.load(DH + r[:, None] * stride_dh + c[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = (dh * _activation_grad(pre, ACT)).to(OUT.dtype.element_ty)
            tl.store(at, dy, mask=mask)
            acc += dy.to(tl.float32)  # masked lanes hold dh = 0: they add nothing
        else:
            tl.store(at, _activation(pre, ACT).to(OUT.dtype.element_ty), mask=mask)
    if BACKWARD:
        tl.store(PARTIALS + split * cols + c, tl.sum(acc, 0), mask=in_cols)


# The launch per direction: [BLOCK_R, BLOCK_C] tiles, WARPS warps, PER_SM programs per SM (column
# blocks x row splits, column_sum_kernel's rule; 4096: one tile per program), STAGES of pipelined
# loads in the row loop. Chosen with benchmarks/tune_bias_activation.py on an H200 over gpt-2.7b's
# widths at tp 1, 2 and 4 ([8192, 10240 | 5120 | 2560] bf16; docs/performance.md, "Memory-bound
# kernels"). The forward: 16 x 256 tiles, one per program, 85.9 and 23.6 us at 10240 and 2560
# columns, against 97.4 and 29.0 for rows of 1,024 columns one at a time. The backward's rule is
# also concat_sum_kernel's (3 x [2048, 4, 2560 | 1280 | 640] too): the fastest, or within 4% of it,
# on five of the six shapes, 8% behind at [8192, 5120] (3% in another sweep). One-tile programs,
# 32 per SM, took 9-42% (backward) and 27-147% (concatenation) longer, more as the widths shrank.
LAUNCH = {False: {"BLOCK_R": 16, "BLOCK_C": 256, "WARPS": 4, "PER_SM": 4096, "STAGES": 1},
          True: {"BLOCK_R": 32, "BLOCK_C": 64, "WARPS": 4, "PER_SM": 4, "STAGES": 3}}
MAX_SPLITS = 65535  # the grid's second dimension
INTERPRET_LAUNCH = {"BLOCK_R": 16, "BLOCK_C": 32, "WARPS": 1, "PER_SM": 4, "STAGES": 1}  # CPU: small tiles


def _grid_rows(rows: int, column_blocks: int, sms: int, cfg: dict):
    """(rows per program, row splits) of the grid: column_sum's rule, capped at MAX_SPLITS splits."""
    rows_per_split = _row_split(rows, column_blocks, sms, cfg["BLOCK_R"], cfg["PER_SM"])
    if triton.cdiv(rows, rows_per_split) > MAX_SPLITS:  # long inputs: more rows per program
        rows_per_split = triton.cdiv(triton.cdiv(rows, MAX_SPLITS), cfg["BLOCK_R"]) * cfg["BLOCK_R"]
    return rows_per_split, max(1, triton.cdiv(rows, rows_per_split))


def triton_bias_activation(y: torch.Tensor, bias: torch.Tensor, activation: str, dh=None, launch=None):
    """Forward (dh None): act(y + bias), [rows, cols] in y's dtype. Backward: (dy in dh's dtype,
    fp32 [cols] bias gradient). y and dh: [rows, cols] with last-dim stride 1; bias [cols].
    `launch` overrides keys of the direction's LAUNCH (benchmarks/tune_bias_activation.py)."""
    rows, cols = y.shape
    backward = dh is not None
    rule = LAUNCH[backward] if y.is_cuda else INTERPRET_LAUNCH
    cfg = dict(rule, **(launch or {}))
    sms = _sm_count(y.device) if y.is_cuda else INTERPRET_SMS
    column_blocks = triton.cdiv(cols, cfg["BLOCK_C"])
    rows_per_split, splits = _grid_rows(rows, column_blocks, sms, cfg)
    out = torch.empty(rows, cols, device=y.device, dtype=(dh if backward else y).dtype)
    partials = torch.empty(splits, cols, device=y.device, dtype=torch.float32) if backward else None
    _bias_activation_kernel[(column_blocks, splits)](
        y, bias, dh, out, partials, rows, cols, y.stride(0), dh.stride(0) if backward else 0, rows_per_split,
        ACT=ACTIVATION_IDS[activation], BACKWARD=backward, BLOCK_R=cfg["BLOCK_R"], BLOCK_C=cfg["BLOCK_C"],
        STAGES=cfg["STAGES"], num_warps=cfg["WARPS"])
    return (out, sum_partials(partials)) if backward else out
