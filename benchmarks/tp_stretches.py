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

tp=N's stretches are set against 1/N of tp=1's (what perfect scaling would give), in us, and so is
the time the GEMM kernels that start in each stretch run (on any stream; mean per block for the
blocks' stretches): at tp=N GEMMs as wide as 1/N of tp=1's, beside the transfers, may run slower.

    python3 benchmarks/tp_stretches.py TP1_TRACE TPN_TRACE --tp N [--blocks L] [--kernels K]

--kernels K adds the K kernels other than GEMMs whose time in the step (by name, digits folded,
any stream) exceeds 1/N of tp=1's the most: the memory-bound kernels whose launches do not shrink
with the widths, the collectives' kernels, the copies that tp=1 does not run.

The attention kernels are found by name (cuDNN's and tpflash's Triton kernels by default; --forward and
--backward take other regular expressions), and so are the GEMMs (cuBLAS's by default; --gemms). The trace must hold a step from its start and the next
step's first block; --blocks defaults to the forward attention kernels before the first backward one.
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
from typing import Dict, List, Tuple

FORWARD = r"flash_fprop|_attn_fwd_kernel"
BACKWARD = r"flash_bprop|_attn_dkdv_kernel"
GEMMS = r"nvjet|gemm|xmma|cutlass"  # cuBLAS(Lt)'s kernels on Hopper and before
STRETCHES = ("block forward", "block backward", "head and loss", "tail", "step")

Kernel = Tuple[float, float, str]  # start (us), duration (us), name


def load_kernels(path: str) -> List[Kernel]:
    """The GPU kernels of a chrome trace (.json or .json.gz), in start order."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return sorted((e["ts"], e.get("dur", 0.0), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and e.get("cat") == "kernel")


def starts(kernels: List[Kernel], pattern: str) -> List[float]:
    """Start times (us) of the kernels whose name matches `pattern`, in order."""
    regex = re.compile(pattern)
    return [ts for ts, _, name in kernels if regex.search(name)]


def kernel_starts(path: str, pattern: str) -> List[float]:
    """Start times (us) of the GPU kernels whose name matches `pattern`, in order, from a chrome trace."""
    return starts(load_kernels(path), pattern)


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
    return {name: sum(end - start for start, end in spans) / len(spans)
            for name, spans in windows(forward, backward, blocks).items()}


def windows(forward: List[float], backward: List[float], blocks: int) -> Dict[str, List[Tuple[float, float]]]:
    """Each stretch of the first step as its (start, end) windows (us): one per block for the blocks'
    stretches, one for the others; checks as `stretches`."""
    f, b = forward[:blocks + 1], backward[:blocks]
    if not f[blocks - 1] < b[0] < b[-1] < f[blocks]:
        raise ValueError(f"the attention kernels do not fall into steps of {blocks} blocks (a wrong --blocks, "
                         "or the backward recomputes the forward?)")
    return {"block forward": list(zip(f[:blocks - 1], f[1:blocks])),
            "block backward": list(zip(b[:-1], b[1:])),
            "head and loss": [(f[blocks - 1], b[0])],
            "tail": [(b[-1], f[blocks])],
            "step": [(f[0], f[blocks])]}


def busy(kernels: List[Kernel], spans: List[Tuple[float, float]], pattern: str) -> float:
    """Mean over `spans` of the time (us) the kernels matching `pattern` that start in a span run."""
    regex = re.compile(pattern)
    total = sum(dur for ts, dur, name in kernels if regex.search(name) and any(a <= ts < z for a, z in spans))
    return total / len(spans)


def kernel_times(kernels: List[Kernel], span: Tuple[float, float], exclude: str) -> Dict[str, float]:
    """Time (us) per kernel name (digits folded to '#', so one kernel at other shapes or template
    arguments is one name) of the kernels that start in `span`, leaving out those matching `exclude`."""
    regex, times = re.compile(exclude), {}
    for ts, dur, name in kernels:
        if span[0] <= ts < span[1] and not regex.search(name):
            key = re.sub(r"\d+", "#", name)[:100]
            times[key] = times.get(key, 0.0) + dur
    return times


def kernel_table(one: Dict[str, float], tp_n: Dict[str, float], tp: int, top: int) -> str:
    """Markdown rows of the `top` kernel names whose step time at tp=N exceeds 1/tp of tp=1's the most."""
    over = sorted(((tp_n.get(k, 0.0) - one.get(k, 0.0) / tp, k) for k in set(one) | set(tp_n)), reverse=True)
    rows = [f"| kernel | 1/{tp} of tp=1 | tp={tp} | over |", "|---|---:|---:|---:|"]
    rows += [f"| `{k}` | {one.get(k, 0.0) / tp:,.0f} | {tp_n.get(k, 0.0):,.0f} | {d:+,.0f} |" for d, k in over[:top]]
    return "\n".join(rows)


def table(one: Dict[str, float], tp_n: Dict[str, float], tp: int, gemms=None) -> str:
    """Markdown rows: each stretch at 1/tp of tp=1, at tp=N, and the difference (us); with `gemms` (the
    GEMMs' time per stretch, a dict like `one` for tp=1 and for tp=N) the same three for them."""
    head = f"| stretch | 1/{tp} of tp=1 | tp={tp} | over |"
    rows = [head + (" GEMMs, 1/{0} of tp=1 | tp={0} | over |".format(tp) if gemms else ""),
            "|---|---:|---:|---:|" + ("---:|---:|---:|" if gemms else "")]
    for name in STRETCHES:
        cells = [one[name] / tp, tp_n[name]] + ([gemms[0][name] / tp, gemms[1][name]] if gemms else [])
        row = f"| {name} | {cells[0]:,.0f} | {cells[1]:,.0f} | {cells[1] - cells[0]:+,.0f} |"
        if gemms:
            row += f" {cells[2]:,.0f} | {cells[3]:,.0f} | {cells[3] - cells[2]:+,.0f} |"
        rows.append(row)
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tp1_trace")
    p.add_argument("tpn_trace")
    p.add_argument("--tp", type=int, required=True, help="the second trace's tp")
    p.add_argument("--blocks", type=int, help="transformer blocks in the model (default: counted in the trace)")
    p.add_argument("--forward", default=FORWARD, help="regular expression of the forward attention kernel")
    p.add_argument("--backward", default=BACKWARD, help="regular expression of the backward attention kernel")
    p.add_argument("--gemms", default=GEMMS, help="regular expression of the GEMM kernels")
    p.add_argument("--kernels", type=int, default=0, metavar="K",
                   help="also list the K other kernels that lose the most time in the step against 1/N of tp=1")
    args = p.parse_args()
    found, gemms, named = [], [], []
    for path in (args.tp1_trace, args.tpn_trace):
        kernels = load_kernels(path)
        forward, backward = starts(kernels, args.forward), starts(kernels, args.backward)
        blocks = args.blocks or blocks_in_step(forward, backward)
        found.append(stretches(forward, backward, blocks))
        spans = windows(forward, backward, blocks)
        gemms.append({name: busy(kernels, window, args.gemms) for name, window in spans.items()})
        named.append(kernel_times(kernels, spans["step"][0], args.gemms))
    print(table(*found, args.tp, gemms))
    if args.kernels:
        print()
        print(kernel_table(*named, args.tp, args.kernels))


if __name__ == "__main__":
    main()
