"""Where a profiled step's GPU time went, from a chrome trace (bench_e2e.py --profile --trace-dir):
kernel time per category, and the span split by what ran alone (e2e_profile.alone_by_category),
with the kernels of the categories asked for listed by time. Runs on CPU over a fetched trace.

    python3 scripts/trace_categories.py trace_tp2_rank0.json[.gz] [--steps 2] [--list other,barrier]
"""
from __future__ import annotations

import argparse

from e2e_profile import alone_by_category, category, kernel_breakdown
from trace_lag import GPU_CATS, load


def device_events(path: str):
    """(name, start_ms, end_ms) of every kernel, copy and memset in the trace."""
    return [(e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for e in load(path) if e.get("cat") in GPU_CATS]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps in the trace (bench_e2e profiles 2)")
    ap.add_argument("--list", default="other", help="comma list of categories whose kernels to list")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    kernels = device_events(args.trace)
    busy = kernel_breakdown(kernels, args.steps, top=0)["by_category"]
    print(f"{len(kernels) // args.steps} device events per step; kernel ms/step by category:")
    print("  " + ", ".join(f"{c} {t:.2f}" for c, t in busy.items()))
    print("ms/step by what ran alone:")
    print("  " + ", ".join(f"{c} {t:.2f}" for c, t in alone_by_category(kernels, args.steps).items()))
    for cat in args.list.split(","):
        mine = [k for k in kernels if category(k[0]) == cat]
        top = kernel_breakdown(mine, args.steps, args.top)["top_kernels"]
        print(f"{cat}: {len(mine) // args.steps} per step")
        for name, ms in top:
            print(f"  {ms:7.3f} ms  {name[:150]}")


if __name__ == "__main__":
    main()
