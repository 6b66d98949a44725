"""The dp gradient reduction of replicated training: DDP (what the trainer uses) against one flat all-reduce
after the backward (what it used before the fifteenth session), side by side in one run.

Run under torchrun, one GPU per process, dp = processes / --tp:
    torchrun --nproc_per_node=4 scripts/bench_dp_reduce.py --models gpt-1.3b [--tp 2]
    python scripts/bench_dp_reduce.py --models gpt-1.3b    # one GPU: what the reductions' own passes cost
    python scripts/bench_dp_reduce.py --tiny               # CPU/gloo smoke test: never report its timings
Rows, each for the eager model and for its blocks replayed as CUDA graphs (`-graphs`, CUDA only):
  ddp    tpflash.parallel.replicate_over_dp (as the trainer runs it): 25 MB buckets all-reduced during
         the backward
  flat   after the backward, every gradient concatenated, one all-reduce, divided back (the old way)
  none   no reduction at all (one process only: the floor the two are measured against)
Timing as in bench_e2e.py (scripts/e2e_timing.py): median of steps between two syncs, and the mean
with the host one step ahead.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpflash  # noqa: E402
from tpflash.models import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import MODELS, make_optimizer  # noqa: E402
from e2e_timing import describe, device_name, time_steps  # noqa: E402


class FlatReduceThenStep:
    """An optimizer whose step() first averages every gradient over dp with one flat all-reduce."""

    def __init__(self, opt: torch.optim.Optimizer, params, group):
        self.opt, self.params, self.group = opt, list(params), group

    def step(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        world, offset = dist.get_world_size(self.group), 0
        for g in grads:
            torch.div(flat[offset: offset + g.numel()].view_as(g), world, out=g)
            offset += g.numel()
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True):
        self.opt.zero_grad(set_to_none=set_to_none)


def measure(model_name: str, variant: str, args, ps) -> dict:
    reduction, graphs = variant.split("-")[0], variant.endswith("-graphs")
    shape = MODELS[model_name]
    row = dict(model=model_name, variant=variant, tp=ps.tp_size, dp=ps.dp_size, device=device_name(ps.device))
    torch.manual_seed(0)
    if ps.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ps.device)
    try:
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=shape["layers"], n_head=shape["heads"],
                        n_embd=shape["d"], sequence_parallel=ps.tp_size > 1)
        model = GPT(cfg, process_group=ps.tp_group, device=ps.device)
        if graphs:
            with torch.autocast(ps.device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                model.capture_cuda_graphs(args.batch, args.seq)
        opt = make_optimizer(model, ps.device)
        forward = model
        if reduction == "ddp":
            forward = tpflash.parallel.replicate_over_dp(model, ps)
        elif reduction == "flat":
            opt = FlatReduceThenStep(opt, model.parameters(), ps.dp_group)
        step_s, loss, extra = time_steps(forward, contextlib.nullcontext, opt, args, ps)
        cuda = ps.device.type == "cuda"  # live tensors' peak, and what the allocator held (graph pools too)
        peak = torch.cuda.max_memory_allocated(ps.device) / 2 ** 30 if cuda else float("nan")
        reserved = torch.cuda.max_memory_reserved(ps.device) / 2 ** 30 if cuda else float("nan")
        row.update(step_ms=1e3 * step_s, loss=loss, peak_gib=peak, reserved_gib=reserved, **extra)
    except Exception as exc:  # one failing row must not kill the table
        row["error"] = describe(exc)
    finally:
        model = opt = forward = None
        gc.collect()
        if ps.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def print_table(rows) -> None:
    print("| model | variant | tp | dp | step ms (synced) | one step ahead ms | host ms | SM MHz | peak GiB live / reserved |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['variant']} | {r['tp']} | {r['dp']} | error: {r['error'][:80]} | | | | |")
            continue
        print(f"| {r['model']} | {r['variant']} | {r['tp']} | {r['dp']} | {r['step_ms']:.1f} | {r.get('ahead_ms', float('nan')):.1f}"
              f" | {r['host_ms']:.0f} | {r.get('sm_mhz', float('nan')):.0f} | {r['peak_gib']:.1f} / {r['reserved_gib']:.1f} |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (dp = world size / tp)")
    p.add_argument("--models", default="gpt-1.3b", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--variants", default=None, help="comma list of ddp, flat, none, each optionally with -graphs "
                                                    "(default: all that apply)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="sequences per step per dp rank")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tiny", action="store_true", help="tiny model, a few steps: a CPU/gloo smoke test")
    args = p.parse_args(argv)
    unknown = [v for v in (args.variants or "").split(",") if v and v.removesuffix("-graphs") not in ("ddp", "flat", "none")]
    if unknown:  # before any process group
        p.error(f"--variants: {unknown} are not ddp, flat or none (each optionally with -graphs)")
    # what e2e_timing.time_steps reads
    args.no_telemetry, args.profile, args.cprofile = False, False, None
    if args.tiny:
        args.models, args.steps, args.warmup, args.batch, args.seq, args.vocab = "tiny", 2, 1, 2, 32, 97
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    ps = tpflash.parallel.init(tp=args.tp)
    args.dtype = "bf16" if ps.device.type == "cuda" else "fp32"
    args.no_telemetry = args.no_telemetry or ps.device.type != "cuda"
    variants = args.variants.split(",") if args.variants else (
        ["ddp", "flat"] + (["none"] if ps.dp_size == 1 else []))
    if ps.device.type == "cuda" and not args.variants:
        variants += [f"{v}-graphs" for v in variants]
    if ps.dp_size > 1 and any(v.startswith("none") for v in variants):
        raise SystemExit("variant 'none' (no reduction) is only a floor for one process; drop it at dp > 1")
    rows = [measure(m, v, args, ps) for m in args.models.split(",") for v in variants]
    if dist.get_rank() == 0:
        print_table(rows)
    tpflash.parallel.shutdown()


if __name__ == "__main__":
    main()
