"""Loss curves and a table from the runs of benchmarks/fp8_accuracy.sh.

    python benchmarks/fp8_accuracy_plot.py RUNS_DIR [RUNS_DIR ...] [--png docs/fp8_accuracy.png] [--title TEXT]

Each RUNS_DIR (fp8_accuracy.sh writes one per seed: OUT/seed<SEED>) holds one directory per mode, each with a metrics.jsonl: the trainer's (off, rowwise,
tensorwise) and, where fp8_accuracy.sh ran it (PEERS=...), the plain-PyTorch peer's from
benchmarks/fp8_accuracy_peer.py (bf16, torchao-tensorwise, torchao-rowwise). Prints a markdown table:
the final training loss (the mean of the last --tail logged values, which smooths batch noise) and the
last eval loss, each in percent against the same model's run with bf16 GEMMs (tpflash's fp8 recipes
against off: bf16 GEMMs on a GPU, fp32 on CPU; torchao's against the peer's bf16; the peer's bf16
against off), the highest training loss after warmup, whether any value was NaN/inf, and the training
throughput. Given several RUNS_DIRs (seeds), a last table has each mode's losses averaged over them,
in percent against the mean of its baseline's, beside each seed's own eval gap: one seed's gap at
1,000 steps is mostly that trajectory's (docs/fp8.md, "Accuracy at scale"). The PNG (matplotlib,
imported only for it) has the training curves of every RUNS_DIR, eval losses marked.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, List

MODES = ("off", "rowwise", "tensorwise", "delayed")  # tpflash's trainer, --model.fp8=MODE
PEER_MODES = ("bf16", "torchao-tensorwise", "torchao-rowwise")  # fp8_accuracy_peer.py --mode MODE
# the run each mode's "vs" columns compare with: the same model with bf16 GEMMs (none for off itself)
BASELINE = {"rowwise": "off", "tensorwise": "off", "delayed": "off", "bf16": "off",
            "torchao-tensorwise": "bf16", "torchao-rowwise": "bf16"}


def read_runs(runs_dir: str) -> Dict[str, Dict[str, List[dict]]]:
    """{mode: {"train": [...], "eval": [...], "summary": [...]}} for every mode with a metrics.jsonl."""
    runs = {}
    for mode in MODES + PEER_MODES:
        path = os.path.join(runs_dir, mode, "metrics.jsonl")
        if not os.path.exists(path):
            continue
        kinds: Dict[str, List[dict]] = {"train": [], "eval": [], "summary": []}
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    kinds.setdefault(record["kind"], []).append(record)
        runs[mode] = kinds
    if not runs:
        raise SystemExit(f"no {MODES} runs (nor peer runs {PEER_MODES}) with a metrics.jsonl under {runs_dir}")
    return runs


def summarise(records: Dict[str, List[dict]], tail: int) -> dict:
    """The table's numbers for one run."""
    train = records["train"]
    losses = [r["loss"] for r in train]
    finite = all(math.isfinite(x) for x in losses) and all(math.isfinite(r["eval_loss"]) for r in records["eval"])
    after_warmup = [r["loss"] for r in train if r["step"] > train[-1]["step"] // 10] or losses
    rates = [r["tokens_per_s"] for r in train[len(train) // 2:] if "tokens_per_s" in r]
    return dict(step=train[-1]["step"], final=sum(losses[-tail:]) / len(losses[-tail:]),
                eval=records["eval"][-1]["eval_loss"] if records["eval"] else float("nan"),
                peak=max(after_warmup), finite=finite,
                tokens_per_s=sorted(rates)[len(rates) // 2] if rates else float("nan"))


def table(runs: Dict[str, Dict[str, List[dict]]], tail: int) -> str:
    rows = {mode: summarise(records, tail) for mode, records in runs.items()}
    lines = [f"| run | steps | final train loss (mean of last {tail} logs) | vs bf16 | last eval loss | vs bf16 "
             "| highest loss after 10% of steps | NaN/inf | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for mode, r in rows.items():
        base = rows.get(BASELINE.get(mode))
        rel = lambda key: "" if base is None else f"{100 * (r[key] / base[key] - 1):+.2f}%"  # noqa: E731
        lines.append(f"| {mode} | {r['step']} | {r['final']:.4f} | {rel('final')} | {r['eval']:.4f} | {rel('eval')} "
                     f"| {r['peak']:.3f} | {'none' if r['finite'] else 'yes'} | {r['tokens_per_s']:.4g} |")
    return "\n".join(lines)


def mean_table(runs_by_dir: Dict[str, Dict[str, Dict[str, List[dict]]]], tail: int) -> str:
    """Each mode run in every directory: its final train and last eval loss averaged over the directories
    (seeds), against the same mean of its baseline, and each directory's own eval gap."""
    dirs = list(runs_by_dir)
    summaries = {d: {mode: summarise(records, tail) for mode, records in runs.items()} for d, runs in runs_by_dir.items()}
    modes = [m for m in MODES + PEER_MODES if all(m in summaries[d] for d in dirs)]
    mean = {m: {k: sum(summaries[d][m][k] for d in dirs) / len(dirs) for k in ("final", "eval")} for m in modes}
    names = ", ".join(os.path.basename(os.path.normpath(d)) for d in dirs)
    lines = [f"| run | mean final train loss | vs bf16 | mean last eval loss | vs bf16 | eval vs bf16 per run ({names}) |",
             "|---|---:|---:|---:|---:|---|"]
    for m in modes:
        base = BASELINE.get(m) if BASELINE.get(m) in mean else None
        rel = lambda a, b: f"{100 * (a / b - 1):+.2f}%"  # noqa: E731
        each = ", ".join(rel(summaries[d][m]["eval"], summaries[d][base]["eval"]) for d in dirs) if base else ""
        lines.append(f"| {m} | {mean[m]['final']:.4f} | {rel(mean[m]['final'], mean[base]['final']) if base else ''} "
                     f"| {mean[m]['eval']:.4f} | {rel(mean[m]['eval'], mean[base]['eval']) if base else ''} | {each} |")
    return "\n".join(lines)


def plot(runs_by_dir: Dict[str, Dict[str, Dict[str, List[dict]]]], png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    colors = {}  # one colour per mode, one line style per directory (seed)
    for d, style in zip(runs_by_dir, ("-", "--", ":", "-.") * len(runs_by_dir)):
        seed = os.path.basename(os.path.normpath(d))
        for mode, records in runs_by_dir[d].items():
            label = (f"fp8 {mode}" if mode in MODES else f"peer {mode}") + (f", {seed}" if len(runs_by_dir) > 1 else "")
            line, = ax.plot([r["step"] for r in records["train"]], [r["loss"] for r in records["train"]], style,
                            label=label, linewidth=1.0, color=colors.get(mode))
            colors[mode] = line.get_color()
            ax.plot([r["step"] for r in records["eval"]], [r["eval_loss"] for r in records["eval"]], "o",
                    color=line.get_color(), markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token); dots: eval")
    ax.set_title(title)
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs_dirs", nargs="+", metavar="RUNS_DIR")
    p.add_argument("--png", default="", help="write the loss curves here (needs matplotlib)")
    p.add_argument("--title", default="bf16 GEMMs and each fp8 recipe, same init and data")
    p.add_argument("--tail", type=int, default=10, help="logged training losses averaged for the final value")
    args = p.parse_args(argv)
    runs_by_dir = {d: read_runs(d) for d in args.runs_dirs}
    for d, runs in runs_by_dir.items():
        print(f"{d}:\n{table(runs, args.tail)}\n")
    if len(runs_by_dir) > 1:
        print(f"mean over {len(runs_by_dir)} runs:\n{mean_table(runs_by_dir, args.tail)}")
    if args.png:
        plot(runs_by_dir, args.png, args.title)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
