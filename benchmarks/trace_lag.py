"""Is a profiled step host-bound or device-bound? Reads a chrome trace (bench_e2e.py --profile --trace-dir).

For every GPU kernel the trace links the host's launch call (cudaLaunchKernel & co.) by correlation id:
    lag = kernel start - launch call start
A device-bound step keeps a queue of launched work ahead of the GPU, so most lags are long (ms); a
host-bound step has the GPU waiting for each launch, so lags are short and the GPU sits idle between
kernels. The script prints the lag distribution, the GPU's idle time, and which host ops were
issuing the kernels that ended the longest idle gaps.

    python3 benchmarks/trace_lag.py trace_gpt-1.3b_tpflash-graphs_tp2_rank0.json [--steps 2]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from typing import Dict, List, Tuple

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load(path: str) -> List[dict]:
    """The complete ("X") events of a chrome trace, .json or .json.gz."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def split(events: List[dict]) -> Tuple[List[dict], Dict[int, dict], List[dict]]:
    """(GPU events sorted by start, {correlation: launch call}, CPU ops sorted by start)."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    return gpu, launches, ops


def idle_gaps(gpu: List[dict], min_us: float = 10.0) -> List[Tuple[float, float, dict]]:
    """(gap start, gap length, the GPU event that ends it) for idle periods of at least min_us."""
    gaps, busy_until = [], None
    for e in gpu:
        if busy_until is not None and e["ts"] - busy_until >= min_us:
            gaps.append((busy_until, e["ts"] - busy_until, e))
        busy_until = max(busy_until or e["ts"], e["ts"] + e["dur"])
    return gaps


def enclosing_op(ops: List[dict], starts: List[float], ts: float) -> str:
    """Name of the innermost CPU op running at host time ts (the one that started last), or "?"."""
    i = bisect.bisect_right(starts, ts) - 1
    while i >= 0:
        if ops[i]["ts"] + ops[i]["dur"] >= ts:
            return ops[i]["name"]
        i -= 1
    return "?"


def summarise(events: List[dict], steps: int = 1, top: int = 15) -> dict:
    gpu, launches, ops = split(events)
    lags = [e["ts"] - launches[e["args"]["correlation"]]["ts"] for e in gpu
            if e.get("args", {}).get("correlation") in launches]
    span = (gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]) if gpu else 0.0
    gaps = idle_gaps(gpu)
    starts = [o["ts"] for o in ops]
    by_op: Dict[str, List[float]] = {}
    for _, length, ender in gaps:
        launch = launches.get(ender.get("args", {}).get("correlation"))
        name = enclosing_op(ops, starts, launch["ts"]) if launch else "?"
        by_op.setdefault(name, []).append(length)
    ranked = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:top]
    q = statistics.quantiles(lags, n=10) if len(lags) >= 10 else [float("nan")] * 9
    return {
        "kernels_per_step": len(gpu) / steps,
        "gpu_span_ms": span / 1e3 / steps,
        "gpu_idle_ms": sum(g[1] for g in gaps) / 1e3 / steps,
        "lag_ms_p10_p50_p90": (q[0] / 1e3, q[4] / 1e3, q[8] / 1e3),
        "short_lag_fraction": sum(lag < 50 for lag in lags) / max(1, len(lags)),
        "idle_by_host_op_ms": [(name, sum(v) / 1e3 / steps, len(v) // steps) for name, v in ranked],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, default=2, help="steps in each trace (bench_e2e profiles 2)")
    args = p.parse_args(argv)
    for path in args.traces:
        s = summarise(load(path), args.steps)
        p10, p50, p90 = s["lag_ms_p10_p50_p90"]
        print(f"{path}: {s['kernels_per_step']:.0f} kernels/step, GPU span {s['gpu_span_ms']:.1f} ms, "
              f"idle {s['gpu_idle_ms']:.1f} ms; launch->start lag p10/p50/p90 {p10:.2f}/{p50:.2f}/{p90:.2f} ms, "
              f"{100 * s['short_lag_fraction']:.0f}% under 50 us")
        for name, ms, count in s["idle_by_host_op_ms"]:
            print(f"    idle {ms:7.2f} ms in {count:5d} gaps ended by a launch inside {name[:90]}")


if __name__ == "__main__":
    main()
