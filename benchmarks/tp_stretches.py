"""Where a tp=N training step loses time against tp=1, stretch by stretch, from two profiler traces.

Both traces are rank 0's from `bench_e2e.py --profile --trace-dir DIR` (tp=1 on one GPU, tp=N on N).
Each step is cut at the blocks' attention kernels, which every block runs once forward and once
backward (no full recomputation):

    block forward    one forward attention kernel to the next (mean over the step's blocks)
    block backward   one backward attention kernel to the next (mean)
    head and loss    the last block's forward attention to the first backward one: the rest of
                     that block's forward, the final norm, the head and loss, and the first
                     block's backward up to its attention
    tail             the last backward attention to the next step's first forward one: the rest of
                     that block's backward, the embedding's, the optimizer and the next step's start
    step             one forward attention kernel to the same one of the next step

tp=N's stretches are set against 1/N of tp=1's (what perfect scaling would give), in us:

    python3 benchmarks/tp_stretches.py TP1_TRACE TPN_TRACE --tp N [--blocks L]

The attention kernels are found by name (cuDNN's and tpflash's Triton kernels by default; --forward and
--backward take other regular expressions). The trace must hold a step from its start and the next
step's first block; --blocks defaults to the forward attention kernels before the first backward one.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from typing import Dict, List

FORWARD = r"flash_fprop|_attn_fwd_kernel"
BACKWARD = r"flash_bprop|_attn_dkdv_kernel"
STRETCHES = ("block forward", "block backward", "head and loss", "tail", "step")


def kernel_starts(path: str, pattern: str) -> List[float]:
    """Start times (us) of the GPU kernels whose name matches `pattern`, in order, from a chrome trace
    (.json or .json.gz)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    regex = re.compile(pattern)
    return sorted(e["ts"] for e in events
                  if e.get("ph") == "X" and e.get("cat") == "kernel" and regex.search(e.get("name", "")))


def blocks_in_step(forward: List[float], backward: List[float]) -> int:
    """The forward attention kernels before the first backward one: the blocks, where the trace starts
    with a step."""
    return sum(1 for t in forward if not backward or t < backward[0])


def stretches(forward: List[float], backward: List[float], blocks: int) -> Dict[str, float]:
    """The first step's stretches (us) from its attention kernels' start times: `blocks` forward and
    `blocks` backward per step, and at least the next step's first forward one."""
    if blocks < 2:
        raise ValueError(f"blocks={blocks}: the stretches need at least 2 blocks")
    if len(forward) < blocks + 1 or len(backward) < blocks:
        raise ValueError(f"{len(forward)} forward and {len(backward)} backward attention kernels: one step of "
                         f"{blocks} blocks and the next step's first forward one need {blocks + 1} and {blocks}")
    f, b = forward[:blocks + 1], backward[:blocks]
    if not f[blocks - 1] < b[0] < b[-1] < f[blocks]:
        raise ValueError(f"the attention kernels do not fall into steps of {blocks} blocks (a wrong --blocks, "
                         "or the backward recomputes the forward?)")
    return {"block forward": (f[blocks - 1] - f[0]) / (blocks - 1),
            "block backward": (b[-1] - b[0]) / (blocks - 1),
            "head and loss": b[0] - f[blocks - 1],
            "tail": f[blocks] - b[-1],
            "step": f[blocks] - f[0]}


def table(one: Dict[str, float], tp_n: Dict[str, float], tp: int) -> str:
    """Markdown rows: each stretch at 1/tp of tp=1, at tp=N, and the difference (us)."""
    rows = [f"| stretch | 1/{tp} of tp=1 | tp={tp} | over |", "|---|---:|---:|---:|"]
    for name in STRETCHES:
        ideal = one[name] / tp
        rows.append(f"| {name} | {ideal:,.0f} | {tp_n[name]:,.0f} | {tp_n[name] - ideal:+,.0f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tp1_trace")
    p.add_argument("tpn_trace")
    p.add_argument("--tp", type=int, required=True, help="the second trace's tp")
    p.add_argument("--blocks", type=int, help="transformer blocks in the model (default: counted in the trace)")
    p.add_argument("--forward", default=FORWARD, help="regular expression of the forward attention kernel")
    p.add_argument("--backward", default=BACKWARD, help="regular expression of the backward attention kernel")
    args = p.parse_args()
    found = []
    for path in (args.tp1_trace, args.tpn_trace):
        forward, backward = kernel_starts(path, args.forward), kernel_starts(path, args.backward)
        found.append(stretches(forward, backward, args.blocks or blocks_in_step(forward, backward)))
    print(table(*found, args.tp))


if __name__ == "__main__":
    main()
