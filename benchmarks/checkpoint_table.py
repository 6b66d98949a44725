"""The table of benchmarks/checkpoint_timing.sh's results: each save, load and export against the disk.

    python benchmarks/checkpoint_table.py OUT

Reads OUT/disk.log (dd's rates), OUT/{save,cached,load,async}/metrics.jsonl (the trainer's "checkpoint"
records) and OUT/dcp/metrics.jsonl (PyTorch DCP's own saves, benchmarks/checkpoint_dcp_peer.py). The async save's cost is the mean step time while its background write ran against the
mean step time of the other steps (steps 1-4 left out: compilation and warm-up), plus its staging
(the blocking part) spread over the checkpoint interval.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Dict, List, Optional


PARTS = ("state_s", "staging_s", "dcp_write_s", "checksums_s", "commit_s")  # the trainer's save parts


def disk_rates(path: str) -> Dict[str, float]:
    """{"write 1", "read 1", "write N"} in GB/s from disk.log."""
    rates = {}
    if not os.path.exists(path):
        return rates
    for line in open(path):
        found = re.match(r"disk (write|read), (\d+) (?:writers?|readers?): .*?([\d.]+) ([GM])B/s", line)
        if found:
            kind, n, value, unit = found.groups()
            rates[f"{kind} {n}"] = float(value) / (1000 if unit == "M" else 1)
    return rates


def records(out: str, phase: str) -> List[dict]:
    path = os.path.join(out, phase, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def async_cost(rows: List[dict]) -> Optional[Dict[str, float]]:
    """Mean step seconds during and outside the first async save's background write (per-step train
    records: a step ran between its record's time and the previous one's)."""
    staged = next((r for r in rows if r["kind"] == "checkpoint" and "staged_s" in r), None)
    written = next((r for r in rows if r["kind"] == "checkpoint" and "write_s" in r and staged
                    and r["step"] == staged["step"]), None)
    if staged is None or written is None:
        return None
    k, end = staged["step"], staged["time"] + written["write_s"]
    times = {r["step"]: r["time"] for r in rows if r["kind"] == "train"}
    seconds = {s: t - times[s - 1] for s, t in times.items() if s > 4 and s - 1 in times}
    during = [t for s, t in seconds.items() if s >= k + 2 and times[s] <= end]  # k + 1 holds the staging
    outside = [t for s, t in seconds.items() if s <= k or times[s - 1] >= end]
    if not during or not outside:
        return None
    return {"during": sum(during) / len(during), "outside": sum(outside) / len(outside), "n_during": len(during),
            "interval": k, "staged_s": staged["staged_s"], "write_s": written["write_s"]}


def main(out: str) -> None:
    disk = disk_rates(os.path.join(out, "disk.log"))
    writers = max((int(k.split()[1]) for k in disk if k.startswith("write")), default=1)
    print("disk: " + ", ".join(f"{k} {'writer' if 'write' in k else 'reader'}(s) {v:.2f} GB/s" for k, v in disk.items()))
    print("\n| operation | seconds | GB | GB/s | of the disk's | parts (s) |\n|---|---:|---:|---:|---:|---|")
    names = {"save_s": ("save", f"write {writers}"), "write_s": ("async save, background write", f"write {writers}"),
             "load_s": ("load (checksums verified)", "read 1"), "export_s": ("Hugging Face export", f"write {writers}")}
    for phase in ("save", "cached", "load", "async", "dcp"):
        for r in records(out, phase):
            for key, (label, ref) in names.items():
                if r["kind"] == "checkpoint" and key in r:
                    share = f"{r['GB_per_s'] / disk[ref]:.0%}" if ref in disk else "n/a"
                    parts = ", ".join(f"{k[:-2]} {r[k]:.1f}" for k in PARTS if k in r)
                    print(f"| {phase}: {label}, step {r['step']} | {r[key]:.1f} | {r['GB']:.1f} | "
                          f"{r['GB_per_s']:.2f} | {share} | {parts} |")
    cost = async_cost(records(out, "async"))
    if cost:
        slow = cost["during"] / cost["outside"] - 1
        staging = cost["staged_s"] / (cost["interval"] * cost["outside"])
        print(f"\nasync save: staging blocked {cost['staged_s']:.1f} s; the write took {cost['write_s']:.1f} s, "
              f"over {cost['n_during']} steps of {cost['during']:.3f} s against {cost['outside']:.3f} s without "
              f"(+{slow:.1%}); staging over a {cost['interval']}-step interval: +{staging:.1%}")


if __name__ == "__main__":
    main(sys.argv[1])
