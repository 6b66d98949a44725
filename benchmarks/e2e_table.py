"""The markdown table of benchmarks/bench_e2e.py's result rows, with TP scaling efficiency."""
from __future__ import annotations

from typing import Dict, Optional, Sequence


def table(rows: list, impls: Sequence[str], baseline: Dict[str, str],
          loss_reference: Optional[Dict[str, str]] = None) -> str:
    """Markdown table of every row, sorted by model, tp and the order of `impls`, with TP scaling
    efficiency: tokens/s per GPU over the one-GPU (tp=1, dp=1) row of the same impl, or of baseline[impl]
    when given (dtensor against plain). Each row's note gives its loss at the first step and after the
    timed steps, and where loss_reference[impl] names another impl (fp8 against bf16), that row's
    loss after the timed steps at the same layout."""
    loss_reference = loss_reference or {}
    last = {(r["model"], r["impl"], r["tp"], r.get("dp", 1)): r["loss"] for r in rows if "loss" in r}
    tp1 = {(r["model"], r["impl"]): r["tok_s_gpu"] for r in rows
           if r["tp"] == 1 and r.get("dp", 1) == 1 and "tok_s_gpu" in r}
    order = {name: i for i, name in enumerate(tuple(impls) + ("collectives-alone",))}
    rows = sorted(rows, key=lambda r: (r["model"], r["tp"], order.get(r["impl"], 99)))
    lines = ["| model | impl | tp x dp | tokens/s/GPU | MFU | step ms | peak GiB | TP eff. | note |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            cells = ["", "", "", "", "", "error: " + r["error"]]
        elif "tok_s_gpu" not in r:  # collectives alone (step_ms only), or a peer not run (a note only)
            cells = ["", "", f"{r['step_ms']:.1f}" if "step_ms" in r else "", "", "", r.get("note", "")]
        else:
            base = tp1.get((r["model"], baseline.get(r["impl"], r["impl"]) if r["tp"] > 1 else r["impl"]))
            eff = f"{r['tok_s_gpu'] / base:.2f}" if base else ""
            loss = f"loss {r['loss_start']:.3f} -> {r['loss']:.3f}" if "loss_start" in r else f"loss {r['loss']:.3f}"
            ref = loss_reference.get(r["impl"])
            ref_loss = last.get((r["model"], ref, r["tp"], r.get("dp", 1)))
            if ref_loss is not None:
                loss += f" ({ref}: {ref_loss:.3f})"
            notes = [loss, r.get("note")]
            if "host_ms" in r:
                notes.append(f"host {r['host_ms']:.0f} ms")
            if "ahead_ms" in r:
                clock = f" at {r['ahead_sm_mhz']:.0f} MHz" if "ahead_sm_mhz" in r else ""
                notes.append(f"{r['ahead_ms']:.1f} ms/step one step ahead{clock}")
            if "sm_mhz" in r:
                notes.append(f"SM {r['sm_mhz']:.0f} MHz, {r['power_w']:.0f} W")
            if "reserved_gib" in r:
                symmetric = f", symmetric {r['symmetric_gib']:.1f}" if r.get("symmetric_gib") else ""
                notes.append(f"memory: steps {r['steps_peak_gib']:.1f} GiB, reserved {r['reserved_gib']:.1f}{symmetric}")
            if "exposed_comm_ms" in r:
                notes.append(f"comm {r['comm_ms']:.1f} ms/step, exposed {r['exposed_comm_ms']:.1f}")
            cells = [f"{r['tok_s_gpu']:,.0f}", f"{r['mfu']:.3f}", f"{r['step_ms']:.1f}",
                     f"{r['peak_gib']:.1f}", eff, "; ".join(filter(None, notes))]
        lines.append("| " + " | ".join([r["model"], r["impl"], f"{r['tp']}x{r['dp']}"] + cells) + " |")
    return "\n".join(lines)
