"""Where a profiled step's GPU stands idle: the gaps between its compute kernels, by what surrounds them.

Reads one rank's chrome trace (`bench_e2e.py --profile --trace-dir DIR`). Copy-engine transfers,
barrier and signal kernels and NCCL kernels are waits, not compute: every stretch of the step in which
no compute kernel runs is a gap, put in a group by the compute kernel before it, the wait that runs in
it (the last one to start, or "-") and the compute kernel after it. The step is cut at its forward
attention kernels as in tp_stretches.py: the trace's second step where it holds two, else its first.

    python3 benchmarks/idle_gaps.py TRACE [--top 20]

prints the step's span and idle time (us) and the largest groups: total us, gaps, before | during | after.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_stretches import BACKWARD, FORWARD  # noqa: E402
from trace_lag import GPU_CATS, load  # noqa: E402

WAITS = r"PtoP|barrier_kernel|wait_signal|put_signal|nccl"  # transfers and waits: no compute
# short names for the kernel families a step is made of; anything else: its name up to the first "<" or "("
FAMILIES = ((r"nvjet|gemm|cutlass", "GEMM"), (FORWARD, "attention forward"), (BACKWARD, "attention backward"),
            (r"Memset", "memset"), (r"PtoP", "peer copy"), (r"barrier_kernel", "barrier"), (r"nccl", "NCCL"),
            (r"wait_signal|put_signal", "signal"), (r"multi_tensor_apply", "optimizer (multi-tensor)"))


def gpu_events(path: str) -> List[dict]:
    """The trace's GPU events (kernels, copies, memsets), sorted by start; .json or .json.gz."""
    return sorted((e for e in load(path) if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])


def one_step(events: List[dict]) -> List[dict]:
    """The events of one step, from a forward attention kernel to the next step's first (exclusive):
    the second step where the trace holds two, else the first (to the trace's end if it has no next)."""
    forward = [i for i, e in enumerate(events) if re.search(FORWARD, e["name"])]
    first_backward = next((e["ts"] for e in events if re.search(BACKWARD, e["name"])), float("inf"))
    blocks = sum(1 for i in forward if events[i]["ts"] < first_backward)
    if blocks == 0:
        raise ValueError("no forward attention kernel before the first backward one: not a training step's trace")
    start = blocks if len(forward) >= 2 * blocks else 0
    end = forward[start + blocks] if len(forward) > start + blocks else len(events)
    return events[forward[start]:end]


def short(name: str) -> str:
    for pattern, family in FAMILIES:
        if re.search(pattern, name):
            return family
    return re.split(r"[<(]", re.sub(r"^void ", "", name))[0].split("::")[-1][:40]


def idle_gaps(step: List[dict]) -> Tuple[float, float, Dict[Tuple[str, str, str], Tuple[float, int]]]:
    """(span, idle us, {(before, during, after): (us, gaps)}) of a step's events."""
    waits = [e for e in step if re.search(WAITS, e["name"])]
    busy_until, last, total = None, None, 0.0
    groups: Dict[Tuple[str, str, str], float] = Counter()
    counts: Dict[Tuple[str, str, str], int] = Counter()
    for e in step:
        if re.search(WAITS, e["name"]):
            continue
        if busy_until is not None and e["ts"] > busy_until:
            during = [w for w in waits if w["ts"] < e["ts"] and w["ts"] + w["dur"] > busy_until]
            key = (short(last["name"]), short(during[-1]["name"]) if during else "-", short(e["name"]))
            groups[key] += e["ts"] - busy_until
            counts[key] += 1
            total += e["ts"] - busy_until
        if busy_until is None or e["ts"] + e["dur"] > busy_until:
            busy_until, last = e["ts"] + e["dur"], e
    span = max(e["ts"] + e["dur"] for e in step) - step[0]["ts"]
    return span, total, {key: (us, counts[key]) for key, us in groups.items()}


def report(span: float, idle: float, groups: Dict[Tuple[str, str, str], Tuple[float, int]], top: int) -> str:
    rows = [f"step span {span:,.0f} us, idle {idle:,.0f} us ({idle / span:.1%})", "",
            "| us | gaps | before | during | after |", "|---:|---:|---|---|---|"]
    for (before, during, after), (us, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        rows.append(f"| {us:,.0f} | {n} | {before} | {during} | {after} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=20, help="groups of gaps to list")
    args = p.parse_args()
    print(report(*idle_gaps(one_step(gpu_events(args.trace))), args.top))


if __name__ == "__main__":
    main()
