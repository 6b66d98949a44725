"""Loss curves and a table from the runs of benchmarks/fp8_accuracy.sh.

    python benchmarks/fp8_accuracy_plot.py RUNS_DIR [--png docs/fp8_accuracy.png] [--title TEXT]

RUNS_DIR holds one directory per mode (off, rowwise, tensorwise), each with the trainer's
metrics.jsonl. Prints a markdown table: the final training loss (the mean of the last --tail
logged values, which smooths batch noise) and the last eval loss, each in percent against the run
with fp8 off (bf16 GEMMs on a GPU, fp32 on CPU), the highest training loss after warmup, whether any
value was NaN/inf, and the training throughput. The PNG (matplotlib, imported only for it) has the
training curves, eval losses marked.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, List

MODES = ("off", "rowwise", "tensorwise")


def read_runs(runs_dir: str) -> Dict[str, Dict[str, List[dict]]]:
    """{mode: {"train": [...], "eval": [...], "summary": [...]}} for every mode with a metrics.jsonl."""
    runs = {}
    for mode in MODES:
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
        raise SystemExit(f"no {MODES} runs with a metrics.jsonl under {runs_dir}")
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
    base = rows.get("off")
    lines = [f"| fp8 | steps | final train loss (mean of last {tail} logs) | vs off | last eval loss | vs off "
             "| highest loss after 10% of steps | NaN/inf | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for mode, r in rows.items():
        rel = lambda key: "" if base is None or mode == "off" else f"{100 * (r[key] / base[key] - 1):+.2f}%"  # noqa: E731
        lines.append(f"| {mode} | {r['step']} | {r['final']:.4f} | {rel('final')} | {r['eval']:.4f} | {rel('eval')} "
                     f"| {r['peak']:.3f} | {'none' if r['finite'] else 'yes'} | {r['tokens_per_s']:.4g} |")
    return "\n".join(lines)


def plot(runs: Dict[str, Dict[str, List[dict]]], png: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for mode, records in runs.items():
        label = f"fp8 {mode}"
        line, = ax.plot([r["step"] for r in records["train"]], [r["loss"] for r in records["train"]],
                        label=label, linewidth=1.0)
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
    p.add_argument("runs_dir")
    p.add_argument("--png", default="", help="write the loss curves here (needs matplotlib)")
    p.add_argument("--title", default="fp8 off and each fp8 recipe, same init and data")
    p.add_argument("--tail", type=int, default=10, help="logged training losses averaged for the final value")
    args = p.parse_args(argv)
    runs = read_runs(args.runs_dir)
    print(table(runs, args.tail))
    if args.png:
        plot(runs, args.png, args.title)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
