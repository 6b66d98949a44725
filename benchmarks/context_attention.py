"""Context-parallel attention across GPUs: ring and all-gather at cp = the number of ranks, against one
flash-attention call over the whole sequence on one GPU.

Every rank holds seq/cp tokens (zigzag layout) of one causal sequence and runs
tpflash.parallel.context_parallel_attention (communication included); rank 0 alone also times the
whole-sequence call while the others wait. For each cp_comm the table gives the slowest rank's
milliseconds and

    speedup = whole_ms / slowest_rank_ms    (cp is the ideal; cp * efficiency)

with each rank's peak memory during a fwd+bwd (GiB above what was allocated before it: the inputs are
not counted) beside the whole call's.

    torchrun --nproc_per_node=2 benchmarks/context_attention.py [--seqs 32768 65536 131072] [--json out.json]
    torchrun --nproc_per_node=2 benchmarks/context_attention.py --device cpu --seqs 256 --heads-q 4 \
        --heads-kv 2 --head-dim 16 --reps 1        # smoke run over gloo
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from tpflash.kernels import flash_attention, use_backend
from tpflash.parallel.context_attention import CP_COMMS, context_parallel_attention


def timed_ms(fn, args, group=None):
    """Median over args.reps of fn's time on this rank (after args.warmup calls); ranks start together."""
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.reps):
        if group is not None:
            dist.barrier(group)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_gib(fn, args):
    """Peak memory of one call after a warm one, above what was allocated just before it (None on CPU). The garbage collector runs first: autograd graphs of earlier cases left in reference cycles
    would otherwise count."""
    if args.device != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def tensors(tokens, args, seed):
    gen = torch.Generator(device=args.device).manual_seed(seed)
    make = lambda heads: torch.randn(1, tokens, heads, args.head_dim, device=args.device, dtype=args.dtype,  # noqa: E731
                                     generator=gen).requires_grad_()
    q, k, v = make(args.heads_q), make(args.heads_kv), make(args.heads_kv)
    return q, k, v, torch.randn(q.shape, device=args.device, dtype=args.dtype, generator=gen)


def fwd_bwd(attend, q, k, v, grad):
    def step():
        q.grad = k.grad = v.grad = None
        attend(q, k, v).backward(grad)
    return step


def run_seq(seq, args):
    cp, rank = dist.get_world_size(), dist.get_rank()
    row = dict(seq=seq)
    if rank == 0:
        q, k, v, grad = tensors(seq, args, 0)
        step = fwd_bwd(lambda *t: flash_attention(*t, causal=True), q, k, v, grad)
        row.update(whole_ms=timed_ms(step, args), whole_peak_gib=peak_gib(step, args))
        del q, k, v, grad, step
        if args.device == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    q, k, v, grad = tensors(seq // cp, args, 1 + rank)
    for comm in CP_COMMS:
        attend = lambda *t, comm=comm: context_parallel_attention(*t, dist.group.WORLD, causal=True, cp_comm=comm)  # noqa: E731
        step = fwd_bwd(attend, q, k, v, grad)
        stats = torch.tensor([timed_ms(step, args, dist.group.WORLD), peak_gib(step, args) or 0.0], dtype=torch.float64)
        slowest = stats.clone().to(args.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        row[f"{comm}_ms"], row[f"{comm}_peak_gib"] = slowest.tolist()
    if rank == 0:
        for comm in CP_COMMS:
            row[f"{comm}_speedup"] = row["whole_ms"] / row[f"{comm}_ms"]
    return row


def print_table(rows, cp, device):
    gib = lambda x: "n/a" if device != "cuda" else f"{x:.2f}"  # noqa: E731
    print(f"| seq | whole fwd+bwd ms (1 GPU) | ring ms | ring speedup | allgather ms | allgather speedup | "
          f"peak GiB whole / ring rank / allgather rank (cp={cp}) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['whole_ms']:.1f} | {r['ring_ms']:.1f} | {r['ring_speedup']:.2f} | "
              f"{r['allgather_ms']:.1f} | {r['allgather_speedup']:.2f} | {gib(r['whole_peak_gib'])} / "
              f"{gib(r['ring_peak_gib'])} / {gib(r['allgather_peak_gib'])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    cp = dist.get_world_size()
    bad = [s for s in args.seqs if s % (2 * cp)]
    if bad:
        raise SystemExit(f"--seqs {bad} must be divisible by 2*cp = {2 * cp} (two zigzag chunks per rank)")
    with use_backend("triton" if args.device == "cuda" else "reference"):
        rows = [run_seq(seq, args) for seq in args.seqs]
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"{cp} x {name}, torch {torch.__version__}, {datetime.date.today()}; causal, batch 1, {args.dtype}, "
              f"heads_q {args.heads_q}, heads_kv {args.heads_kv}, head_dim {args.head_dim}, median of {args.reps}")
        print_table(rows, cp, args.device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=name, cp=cp, torch=torch.__version__, date=str(datetime.date.today()),
                               rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
