"""The communication a tensor-parallel step would expose with no overlap (for scripts/bench_e2e.py):
the SP all-gather and reduce-scatter of one activation timed alone, and the MLP's row-parallel GEMM
with its reduce-scatter serial and pipelined. The row it returns has a step_ms but no tokens/s."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import tpflash
from tpflash.parallel import overlap

from e2e_timing import device_name, sync


def collectives_alone(model_name: str, shape: dict, args, ps) -> dict:
    """Time the SP all-gather and reduce-scatter of one [seq/tp, batch, d] bf16 activation with nothing
    else running: the communication a step would expose if none of it were overlapped (per layer, 4 of
    each: forward gather+scatter for attention and MLP, and their duals in backward)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(args.seq // ps.tp_size, args.batch, shape["d"], device=ps.device, dtype=dtype)
    ag_ms = _median_ms(lambda: tpflash.parallel.comm.all_gather(x, 0, ps.tp_group), ps)
    full = torch.randn(args.seq, args.batch, shape["d"], device=ps.device, dtype=dtype)
    rs_ms = _median_ms(lambda: tpflash.parallel.comm.reduce_scatter(full, 0, ps.tp_group), ps)
    per_step = 4 * shape["layers"] * (ag_ms + rs_ms) + ag_ms + rs_ms  # + the head's gather
    gemm, plain, piped = _row_layer_ms(shape, args, ps, dtype)
    return dict(model=model_name, impl="collectives-alone", tp=ps.tp_size, dp=ps.dp_size,
                device=device_name(ps.device), step_ms=per_step,
                note=f"all-gather {ag_ms:.3f} ms, reduce-scatter {rs_ms:.3f} ms per activation; "
                     f"step_ms = {4 * shape['layers'] + 1} x (both), nothing overlapped. MLP down-proj "
                     f"fwd+bwd: GEMMs alone {gemm:.3f} ms, + reduce-scatter {plain:.3f}, pipelined {piped:.3f}")


def _row_layer_ms(shape, args, ps, dtype):
    """fwd+bwd of the MLP's row-parallel GEMM [s, b, 4d/tp] x [d, 4d/tp]: without collectives, with
    reduce-scatter / all-gather after it (overlap off), and pipelined (tpflash.parallel.overlap)."""
    d, tp, group = shape["d"], ps.tp_size, ps.tp_group
    h = torch.randn(args.seq, args.batch, 4 * d // tp, device=ps.device, dtype=dtype, requires_grad=True)
    w = torch.randn(d, 4 * d // tp, device=ps.device, dtype=dtype, requires_grad=True)
    g_full = torch.randn(args.seq, args.batch, d, device=ps.device, dtype=dtype)
    g_local = g_full[: args.seq // tp]
    comm = tpflash.parallel.comm
    gemm = _median_ms(lambda: F.linear(h, w).backward(g_full), ps)
    plain = _median_ms(lambda: comm.reduce_scatter_along_seq(F.linear(h, w), group).backward(g_local), ps)
    piped = _median_ms(lambda: overlap.linear_reduce_scatter(h, w, group).backward(g_local), ps)
    return gemm, plain, piped


def _median_ms(fn, ps, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync(ps.device)
        t0 = time.perf_counter()
        fn()
        sync(ps.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)
