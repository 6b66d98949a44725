"""TP efficiency on one host: tokens/s/GPU at tp=N over the same GPUs' own tp=1, from bench_e2e results.

The GPUs of one host are not equally fast (each at its power cap, their own tp=1 steps differed by
up to 2.5% on 4 H200s: docs/performance.md, "TP efficiency"), and a tp=N step runs at its slowest
GPU's pace; set against one GPU's tp=1 alone, the efficiency moves with the GPU picked. So tp=1 runs
on every GPU at once, each tp=N group on its own GPUs, and each group is set against the mean of its
GPUs' tp=1. benchmarks/tp_efficiency.sh makes the launches (one call, in the order tp=max, tp=1 on
every GPU, each smaller tp on every group of GPUs, tp=max again) and then runs

    python3 benchmarks/tp_efficiency.py DIR

on its results: DIR/tp{N}_gpus{a-b}.jsonl, one bench_e2e --results file per launch ({a-b}: the first
and last GPU index of the launch, e.g. tp1_gpus2-2, tp4_gpus0-3; a second launch of the same GPUs
adds a suffix: tp4_gpus0-3_b). Prints one markdown table per model. Given several directories and
`--against DIR` (tp_efficiency.sh's AGAINST: runs of this tree around one run of another tree, in
one call), it prints each directory's tables, then every layout's step time in each directory and
the change of their mean against DIR's:

    python3 benchmarks/tp_efficiency.py DIR1 DIR2 --against DIR
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from typing import Dict, List, Tuple

_NAME = re.compile(r"^tp(\d+)_gpus(\d+)-(\d+)(?:_\w+)?\.jsonl$")


def load(directory: str) -> List[dict]:
    """Every result row of DIR's tp*_gpus*.jsonl files, each with its launch's `gpus` (first, last)."""
    rows = []
    for name in sorted(os.listdir(directory)):
        match = _NAME.match(name)
        if not match:
            continue
        tp, first, last = (int(g) for g in match.groups())
        if last - first + 1 != tp:
            raise ValueError(f"{name}: tp={tp} on GPUs {first}-{last} ({last - first + 1} GPUs)")
        with open(os.path.join(directory, name)) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    if row.get("tp") != tp:
                        raise ValueError(f"{name}: a row at tp={row.get('tp')} in a tp={tp} file")
                    rows.append({**row, "gpus": (first, last)})
    return rows


def _speed(r: dict, ahead: bool) -> float:
    """tokens/s/GPU of a row: over its isolated steps (bench_e2e's median between two syncs), or with
    `ahead` over its steps issued one ahead of the GPU, as tpflash's trainer runs them (same tokens
    per step, over `ahead_ms` instead of `step_ms`)."""
    return r["tok_s_gpu"] * r["step_ms"] / r["ahead_ms"] if ahead else r["tok_s_gpu"]


def efficiencies(rows: List[dict], model: str, ahead: bool = False
                 ) -> Tuple[Dict[int, float], List[Tuple[int, Tuple[int, int], float, float]]]:
    """({gpu: its tp=1 tokens/s/GPU (mean over launches)}, [(tp, gpus, tokens/s/GPU, efficiency)] for
    every tp > 1 launch of `model`, against the mean of its GPUs' tp=1); `ahead`: the speeds of steps
    issued one ahead (`_speed`). Raises ValueError where a launch's GPU has no tp=1 row, or a row has
    an error or no tokens/s."""
    mine = [r for r in rows if r.get("model") == model]
    for r in mine:
        if r.get("error") or not r.get("tok_s_gpu"):
            raise ValueError(f"{model} at tp={r['tp']} on GPUs {r['gpus']}: no speed "
                             f"({r.get('error', 'tok_s_gpu missing')})")
    single: Dict[int, List[float]] = {}
    for r in mine:
        if r["tp"] == 1:
            single.setdefault(r["gpus"][0], []).append(_speed(r, ahead))
    tp1 = {gpu: statistics.mean(values) for gpu, values in sorted(single.items())}
    out = []
    for r in sorted((r for r in mine if r["tp"] > 1), key=lambda r: (r["tp"], r["gpus"])):
        first, last = r["gpus"]
        missing = [g for g in range(first, last + 1) if g not in tp1]
        if missing:
            raise ValueError(f"{model} at tp={r['tp']} on GPUs {first}-{last}: no tp=1 row for GPU {missing}")
        reference = statistics.mean(tp1[g] for g in range(first, last + 1))
        out.append((r["tp"], r["gpus"], _speed(r, ahead), _speed(r, ahead) / reference))
    return tp1, out


def table(rows: List[dict]) -> str:
    """One markdown table per model: tp=1 on each GPU, then each tp > 1 launch and its efficiency, and
    where every row timed its steps one ahead too (bench_e2e on CUDA), the same for those."""
    parts = []
    for model in sorted({r["model"] for r in rows}):
        tp1, launches = efficiencies(rows, model)
        both = all(r.get("ahead_ms") and r.get("step_ms") for r in rows if r.get("model") == model)
        ahead = efficiencies(rows, model, ahead=True)[1] if both else [None] * len(launches)
        lines = [f"{model}, tp=1 tokens/s/GPU by GPU: " + ", ".join(f"{g}: {v:,.0f}" for g, v in tp1.items()), "",
                 "| tp | GPUs | tokens/s/GPU | efficiency (against the mean of its GPUs' tp=1) |"
                 + (" one step ahead: tokens/s/GPU | efficiency |" if both else ""),
                 "|---:|---|---:|---:|" + ("---:|---:|" if both else "")]
        for (tp, (a, b), speed, eff), late in zip(launches, ahead):
            lines.append(f"| {tp} | {a}-{b} | {speed:,.0f} | {eff:.3f} |"
                         + (f" {late[2]:,.0f} | {late[3]:.3f} |" if late else ""))
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def step_times(rows: List[dict]) -> Dict[Tuple[str, int, Tuple[int, int]], List[float]]:
    """{(model, tp, gpus): step ms of each launch of that layout, in file order}."""
    out: Dict[Tuple[str, int, Tuple[int, int]], List[float]] = {}
    for r in rows:
        if r.get("error") or not r.get("step_ms"):
            raise ValueError(f"{r.get('model')} at tp={r['tp']} on GPUs {r['gpus']}: no step time "
                             f"({r.get('error', 'step_ms missing')})")
        out.setdefault((r["model"], r["tp"], r["gpus"]), []).append(r["step_ms"])
    return out


def comparison(runs: List[List[dict]], against: List[dict], names: List[str]) -> str:
    """A markdown table: every layout's step ms in each run and in `against`, and the change of the runs'
    mean against against's mean (negative: shorter steps)."""
    theirs = step_times(against)
    ours = [step_times(rows) for rows in runs]
    lines = ["| model | tp | GPUs | " + " | ".join(names) + " | against | change |",
             "|---|---:|---|" + "---:|" * (len(names) + 2)]
    for key in sorted(theirs):
        if any(key not in times for times in ours):
            raise ValueError(f"{key[0]} at tp={key[1]} on GPUs {key[2]}: in the tree measured against only")
        mine = [t for times in ours for t in times[key]]
        change = statistics.mean(mine) / statistics.mean(theirs[key]) - 1
        cells = [", ".join(f"{t:.2f}" for t in times[key]) for times in ours]
        model, tp, (a, b) = key
        lines.append(f"| {model} | {tp} | {a}-{b} | " + " | ".join(cells) +
                     f" | {', '.join(f'{t:.2f}' for t in theirs[key])} | {100 * change:+.1f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("directories", nargs="+", help="where benchmarks/tp_efficiency.sh wrote tp{N}_gpus{a-b}.jsonl")
    p.add_argument("--against", help="a directory of another tree's launches to set every layout's step time against")
    args = p.parse_args()
    if len(args.directories) == 1 and not args.against:
        print(table(load(args.directories[0])))
        return
    for directory in args.directories + ([args.against] if args.against else []):
        print(f"## {directory}\n\n{table(load(directory))}\n")
    if args.against:
        names = [os.path.basename(os.path.normpath(d)) for d in args.directories]
        print(f"## step ms against {args.against}\n\n" +
              comparison([load(d) for d in args.directories], load(args.against), names))


if __name__ == "__main__":
    main()
