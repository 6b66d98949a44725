"""Exposed communication in a training step, from a profiler trace (for benchmarks/bench_e2e.py --profile).

A collective is *exposed* when its kernel runs while no compute kernel runs on the device: that
time is what overlap can still win. From the CUDA kernels of a few profiled steps:
    comm     = |union of NCCL kernel intervals|
    exposed  = |union of NCCL intervals minus union of all other kernel intervals|
both per step, in ms. The interval arithmetic is plain Python, tested on CPU (tests/test_e2e_profile.py).
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Tuple

import torch

Interval = Tuple[float, float]


def union(intervals: Iterable[Interval]) -> List[Interval]:
    """Sorted, non-overlapping intervals covering the same points."""
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def minus(a: List[Interval], b: List[Interval]) -> List[Interval]:
    """Parts of the union `a` not covered by the union `b` (both sorted and disjoint)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def comm_and_exposed(kernels: Iterable[Tuple[str, float, float]]) -> Tuple[float, float]:
    """(comm, exposed) time from (name, start, end) kernel records, in their time unit."""
    comm, compute = [], []
    for name, start, end in kernels:
        (comm if "nccl" in name.lower() else compute).append((start, end))
    comm_u = union(comm)
    return length(comm_u), length(minus(comm_u, union(compute)))


# Kernel name fragments -> category, first match wins (names from cuBLAS, cuDNN, NCCL, Triton, ATen,
# the profiler's copy records, and symmetric memory's barrier kernel).
CATEGORIES = (
    ("comm", ("nccl",)),
    ("copy engine", ("memcpy ptop",)),  # peer-to-peer pushes of the copy-engine overlap, beside compute
    ("barrier", ("barrier",)),  # the peer collectives' device-side barriers
    ("weight cast", ("copyfunctor",)),  # multi-tensor fp32 -> bf16 casts (before "multi_tensor" below)
    ("copy/memset", ("memcpy", "memset")),
    ("attention", ("flash", "fmha", "attn", "cudnn", "sdpa", "_delta_kernel")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "_mm_")),
    ("norm", ("norm",)),
    ("cross-entropy", ("cross_entropy", "_ce_", "log_softmax", "nll_loss")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("rotary", ("rotary",)),
    ("activation", ("swiglu", "bias_activation", "silu", "gelu")),
)


def category(name: str) -> str:
    """The category of a CUDA kernel by its name: one of CATEGORIES' keys or "other"."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(key in low for key in keys):
            return cat
    return "other"


def kernel_breakdown(kernels: Iterable[Tuple[str, float, float]], steps: int = 1, top: int = 12) -> dict:
    """Busy time per category (summed kernel durations, per step) and the `top` kernels by time."""
    per_cat, per_name = {}, {}
    for name, start, end in kernels:
        per_cat[category(name)] = per_cat.get(category(name), 0.0) + (end - start) / steps
        per_name[name] = per_name.get(name, 0.0) + (end - start) / steps
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return {"by_category": dict(sorted(per_cat.items(), key=lambda kv: -kv[1])), "top_kernels": ranked}


def alone_by_category(kernels: Iterable[Tuple[str, float, float]], steps: int = 1) -> dict:
    """How the span from the first kernel's start to the last one's end was spent, per step: the time
    each category ran with no other category beside it (what it alone kept the step waiting for),
    "overlapped" (two or more categories at once) and "idle" (nothing ran)."""
    edges = []
    for name, start, end in kernels:
        cat = category(name)
        edges += [(start, 1, cat), (end, -1, cat)]
    edges.sort(key=lambda e: (e[0], e[1]))  # at one instant, ends before starts
    running, out, prev = {}, {"overlapped": 0.0, "idle": 0.0}, None
    for t, delta, cat in edges:
        if prev is not None and t > prev:
            active = [c for c, n in running.items() if n > 0]
            key = active[0] if len(active) == 1 else ("idle" if not active else "overlapped")
            out[key] = out.get(key, 0.0) + (t - prev) / steps
        running[cat] = running.get(cat, 0) + delta
        prev = t
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _cuda_kernels(prof) -> List[Tuple[str, float, float]]:
    """(name, start_us, end_us) of every device-side event in a finished torch.profiler run."""
    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA and evt.time_range.elapsed_us() > 0:
            out.append((evt.name, evt.time_range.start, evt.time_range.end))
    return out


# CUDA runtime calls that make the host wait for the device: a step that makes them is not host-free.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaFree",
              "cudaMemcpy")  # cudaMemcpy (synchronous), not cudaMemcpyAsync


def host_breakdown(prof, steps: int, top: int = 15) -> dict:
    """Host-side view of profiled steps: CPU ops by self time (ms per step), and how often the host
    called a CUDA runtime function that blocks it (SYNC_CALLS)."""
    per_op = []
    syncs = {}
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            continue
        self_ms = evt.self_cpu_time_total / 1e3 / steps
        per_op.append((self_ms, evt.count // steps, evt.key))
        if evt.key in SYNC_CALLS:
            syncs[evt.key] = (evt.count // steps, self_ms)
    per_op.sort(reverse=True)
    return {"top_host_ops": per_op[:top], "sync_calls": syncs}


def device_time_by_op(prof, steps: int, top: int = 30) -> list:
    """(ms per step, calls per step, op, input shapes) of the CPU ops whose own kernels take the most
    device time: which op launched a kernel (eager steps only: a graph replay is one launch)."""
    rows = []
    for evt in prof.key_averages(group_by_input_shape=True):
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        us = getattr(evt, "self_cuda_time_total", 0.0) if us is None else us
        if us > 0:
            rows.append((us / 1e3 / steps, evt.count // steps, evt.key, str(evt.input_shapes)))
    return sorted(rows, reverse=True)[:top]


def profile_exposed_comm(run_step: Callable[[], None], steps: int = 2, trace: str = "", top: int = 12,
                         ops: int = 0) -> dict:
    """Profile `steps` calls of run_step on CUDA; {"comm_ms", "exposed_comm_ms", "gpu_active_ms"} per step.

    Also prints the GPU time per kernel category, the top kernels, the kernels launched per step,
    and the host's top ops by self time with any blocking CUDA calls: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=ops > 0) as prof:
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
    if trace:  # chrome trace for benchmarks/trace_lag.py (or chrome://tracing / perfetto)
        prof.export_chrome_trace(trace)
    kernels = _cuda_kernels(prof)
    comm, exposed = comm_and_exposed(kernels)
    active = length(union((s, e) for _, s, e in kernels)) / 1e3 / steps  # ms the GPU ran anything
    breakdown = kernel_breakdown([(n, s / 1e3, e / 1e3) for n, s, e in kernels], steps, top)  # ms per step
    busy = sum(breakdown["by_category"].values())
    print(f"[profile] GPU busy {busy:.1f} ms/step (active {active:.1f}, {len(kernels) // steps} kernels) "
          "by category: " + ", ".join(f"{c} {t:.1f}" for c, t in breakdown["by_category"].items()), flush=True)
    alone = alone_by_category([(n, s / 1e3, e / 1e3) for n, s, e in kernels], steps)
    print("[profile] ms/step by what ran alone: " + ", ".join(f"{c} {t:.1f}" for c, t in alone.items()), flush=True)
    for name, t in breakdown["top_kernels"]:
        print(f"[profile]   {t:7.2f} ms  {name[:170]}", flush=True)
    host = host_breakdown(prof, steps)
    print("[profile] host, self time per step (ms, calls):", flush=True)
    for ms, count, name in host["top_host_ops"]:
        print(f"[profile]   {ms:7.2f} ms {count:6d}x  {name[:100]}", flush=True)
    print(f"[profile] blocking CUDA calls per step: {host['sync_calls'] or 'none'}", flush=True)
    if ops:
        print("[profile] ops by the device time of their own kernels, per step (ms, calls, op, input shapes):")
        for ms, count, op, shapes in device_time_by_op(prof, steps, ops):
            print(f"[profile]   {ms:7.2f} ms {count:5d}x  {op[:40]:40s} {shapes[:150]}", flush=True)
    return {"comm_ms": comm / 1e3 / steps, "exposed_comm_ms": exposed / 1e3 / steps, "gpu_active_ms": active}
