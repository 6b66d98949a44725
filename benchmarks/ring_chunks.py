"""What the ring's chunking costs in compute (one GPU): causal attention over a whole sequence in one
Triton flash-attention call, against the block calls that each context-parallel (cp) rank makes in
ring attention (tpflash.parallel.context_attention), with no communication.

A cp rank holds seq/cp tokens in the zigzag layout; over cp ring steps it attends its queries to every
rank's kv block through ring_blocks (one causal block, then cp-1 half blocks), merging the partial
outputs through their log-sum-exp; the backward calls the block backward per block and accumulates dq
and the travelling dk/dv in fp32. Here every kv block is a slice of a local tensor (the block in hand
or the one arriving: a ring rank holds two), so one GPU times the compute of each rank in turn.

How to read the table: "whole" is the single call (forward with lse; forward + backward), "rank" the
slowest / fastest cp rank (equal numbers: the zigzag layout balances the ranks), and
    efficiency = whole_ms / (cp * slowest_rank_ms)
is 1.0 where chunking costs nothing; below 1 is the overhead of smaller kernels and the merges.
Peak memory (GiB above what was allocated before the case: its inputs included) is the whole call's
against one rank's (the largest).

    python benchmarks/ring_chunks.py [--seqs 32768 65536 131072] [--cp 4] [--json out.json]
    python benchmarks/ring_chunks.py --device cpu --seqs 256 --heads-q 4 --heads-kv 2 --head-dim 16 --reps 1
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import time

import torch

from tpflash.kernels import flash_attention, use_backend
from tpflash.kernels.attention_blocks import attention_block_backward, attention_block_forward
from tpflash.parallel.context_attention import _merge, ring_blocks


def rank_forward(q, kv_of, rank, cp, scale):
    """One cp rank's ring forward without communication: (out in q's dtype, fp32 lse [b, hq, s/cp]).
    kv_of(src) gives the stacked k/v [2, b, s/cp, hkv, d] of cp rank src."""
    local = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], local), float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(cp):
        src = (rank - step) % cp
        kv = kv_of(src)
        for rows, cols, causal in ring_blocks(rank, src, local, True):
            block_out, block_lse = attention_block_forward(q[:, rows], kv[0][:, cols], kv[1][:, cols], causal, scale)
            _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
    return out.to(q.dtype), lse


def rank_backward(q, kv_of, rank, cp, scale, out, lse, grad_out):
    """The same rank's ring backward: (dq, the last dk/dv accumulator), each step's fp32 dk/dv
    accumulator added to the previous one as the ring adds the one that arrives."""
    local = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    travelling = None
    for step in range(cp):
        src = (rank - step) % cp
        kv = kv_of(src)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for rows, cols, causal in ring_blocks(rank, src, local, True):
            dq_block, dk_block, dv_block = attention_block_backward(
                q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows], grad_out[:, rows],
                causal, scale)
            dq[:, rows] += dq_block
            dkv[0][:, cols] += dk_block
            dkv[1][:, cols] += dv_block
        if travelling is not None:
            dkv += travelling
        travelling = dkv
    return dq.to(q.dtype), travelling.to(q.dtype)


def whole_case(seq, args):
    """(fwd, fwd_bwd) closures of one flash-attention call over the whole sequence."""
    shape = lambda heads: (1, seq, heads, args.head_dim)  # noqa: E731
    q = torch.randn(shape(args.heads_q), device=args.device, dtype=args.dtype, requires_grad=True)
    k, v = (torch.randn(shape(args.heads_kv), device=args.device, dtype=args.dtype, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)
    fwd = lambda: flash_attention(q, k, v, causal=True, return_lse=True)  # noqa: E731

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd()[0].backward(grad)
    return fwd, fwd_bwd


def rank_case(seq, rank, args):
    """(fwd, fwd_bwd) closures of cp rank `rank`'s block calls; kv blocks alternate between two buffers."""
    local, scale = seq // args.cp, 1.0 / math.sqrt(args.head_dim)
    q = torch.randn(1, local, args.heads_q, args.head_dim, device=args.device, dtype=args.dtype)
    grad = torch.randn_like(q)
    blocks = torch.randn(2, 2, 1, local, args.heads_kv, args.head_dim, device=args.device, dtype=args.dtype)
    kv_of = lambda src: blocks[src % 2]  # noqa: E731 - the block in hand or the one arriving
    fwd = lambda: rank_forward(q, kv_of, rank, args.cp, scale)  # noqa: E731

    def fwd_bwd():
        out, lse = fwd()
        return rank_backward(q, kv_of, rank, args.cp, scale, out, lse, grad)
    return fwd, fwd_bwd


def median_ms(fn, args):
    for _ in range(args.warmup):
        fn()
    times = []
    for _ in range(args.reps):
        if args.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(build, args):
    """{fwd_ms, fwd_bwd_ms, peak_gib, before_gib}: the peak of one fwd+bwd above what was allocated before
    the case was built (its inputs included; None on CPU), and that baseline. A first fwd+bwd runs
    before the peak is reset: Triton's autotuning of new shapes allocates scratch memory that a
    training step past its first does not."""
    cuda = args.device == "cuda"
    before = None
    if cuda:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
    fwd, fwd_bwd = build()
    fwd_bwd()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    peak = None
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        before /= 2**30
    return dict(fwd_ms=median_ms(fwd, args), fwd_bwd_ms=median_ms(fwd_bwd, args), peak_gib=peak, before_gib=before)


def run_seq(seq, args):
    if seq % (2 * args.cp):
        raise SystemExit(f"--seqs {seq} must be divisible by 2*cp = {2 * args.cp} (two zigzag chunks per rank)")
    whole = measure(lambda: whole_case(seq, args), args)
    ranks = [measure(lambda r=r: rank_case(seq, r, args), args) for r in range(args.cp)]
    row = dict(seq=seq, whole=whole, ranks=ranks)
    for key in ("fwd_ms", "fwd_bwd_ms"):
        slowest = max(r[key] for r in ranks)
        row[f"rank_{key}_max"], row[f"rank_{key}_min"] = slowest, min(r[key] for r in ranks)
        row[f"efficiency_{key[:-3]}"] = whole[key] / (args.cp * slowest)
    peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] is not None]
    row["rank_peak_gib"] = max(peaks) if peaks else None
    return row


def print_table(rows, cp):
    gib = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"| seq | whole fwd ms | rank fwd ms max / min | fwd efficiency | whole fwd+bwd ms | "
          f"rank fwd+bwd ms max / min | fwd+bwd efficiency | peak GiB whole | peak GiB rank (cp={cp}) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq']} | {r['whole']['fwd_ms']:.2f} | {r['rank_fwd_ms_max']:.2f} / {r['rank_fwd_ms_min']:.2f} | "
              f"{r['efficiency_fwd']:.3f} | {r['whole']['fwd_bwd_ms']:.2f} | "
              f"{r['rank_fwd_bwd_ms_max']:.2f} / {r['rank_fwd_bwd_ms_min']:.2f} | {r['efficiency_fwd_bwd']:.3f} | "
              f"{gib(r['whole']['peak_gib'])} | {gib(r['rank_peak_gib'])} |")


def environment(args):
    try:
        import triton
    except ImportError:
        triton = None
    device = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or "cpu")
    return dict(device=device, torch=torch.__version__, triton=triton.__version__ if triton else "not installed", date=str(datetime.date.today()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--heads-q", type=int, default=32)
    parser.add_argument("--heads-kv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    env = environment(args)
    print(", ".join(f"{k} {v}" for k, v in env.items()))
    print(f"causal, batch 1, {args.dtype}, heads_q {args.heads_q}, heads_kv {args.heads_kv}, "
          f"head_dim {args.head_dim}, cp {args.cp}, median of {args.reps}")
    with use_backend("triton" if args.device == "cuda" else "reference"):
        rows = [run_seq(seq, args) for seq in args.seqs]
    print_table(rows, args.cp)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "dtype")}
        with open(args.json, "w") as f:
            json.dump(dict(env, **config, dtype=str(args.dtype), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
