"""Overlap in isolation: one sequence-parallel MLP (column up, GELU, row down), forward + backward.

Run under torchrun on N GPUs (tp = N):
    torchrun --nproc_per_node=2 scripts/bench_overlap.py --models gpt-2.7b,gpt-1.3b
Rows, all in one run and each timed with CUDA events (median of --iters after warm-up):
  gemms only    the same local GEMMs at tp=N shapes with no collective at all (the lower bound)
  off           all-gather, GEMMs, reduce-scatter one after the other (tpflash's default)
  pieces k=K    tpflash.parallel.overlap with K NCCL collectives per rank (TPFLASH_OVERLAP_PIECES)
  symm_mem      PyTorch's symmetric-memory collective matmuls (TPFLASH_OVERLAP_BACKEND=symm_mem)
"exposed" = row time - "gemms only": the communication the path leaves uncovered.
CUDA_DEVICE_MAX_CONNECTIONS must be set before CUDA starts: run the script once per setting and
read it in the table's header line.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpflash  # noqa: E402
from tpflash.layers import ParallelMLP  # noqa: E402
from tpflash.parallel import NO_GROUP, overlap  # noqa: E402

MODELS = {"gpt-1.3b": 2048, "gpt-2.7b": 2560, "gpt-6.7b": 4096}


def time_fwd_bwd(layer, x, grad, iters: int, warmup: int = 3) -> float:
    """Median ms of forward + backward, CUDA events, ranks aligned by a barrier before each."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_model(name: str, d: int, args, ps) -> list:
    tp, seq, batch = ps.tp_size, args.seq, args.batch
    x_local = torch.randn(seq // tp, batch, d, device=ps.device, requires_grad=True)  # [seq/tp, b, d]
    grad = torch.randn(seq // tp, batch, d, device=ps.device, dtype=torch.bfloat16)
    mlp = ParallelMLP(d, 4 * d, sequence_parallel=True, process_group=ps.tp_group, device=ps.device)
    rows = []
    # the lower bound: one rank's GEMMs (all tokens x ffn/tp) with no group, hence no collective
    alone = ParallelMLP(d, 4 * d // tp, process_group=NO_GROUP, device=ps.device)
    x_full = torch.randn(seq, batch, d, device=ps.device, requires_grad=True)
    gemm_ms = time_fwd_bwd(alone, x_full, torch.randn(seq, batch, d, device=ps.device, dtype=torch.bfloat16),
                           args.iters)
    rows.append(("gemms only", gemm_ms))
    with overlap.overlap_comm(False):
        rows.append(("off", time_fwd_bwd(mlp, x_local, grad, args.iters)))
    for k in args.pieces:
        os.environ["TPFLASH_OVERLAP_PIECES"] = str(k)
        with overlap.overlap_comm(True):
            rows.append((f"pieces k={k}", time_fwd_bwd(mlp, x_local, grad, args.iters)))
    os.environ["TPFLASH_OVERLAP_BACKEND"] = "symm_mem"
    try:
        with overlap.overlap_comm(True):
            rows.append(("symm_mem", time_fwd_bwd(mlp, x_local, grad, args.iters)))
    except Exception as exc:  # report and go on: the other rows stand
        print(f"[bench_overlap] symm_mem failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    finally:
        del os.environ["TPFLASH_OVERLAP_BACKEND"]
    return [(name, label, ms, ms - gemm_ms) for label, ms in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt-2.7b,gpt-1.3b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--pieces", default="1,2,4", help="comma list of k for the pieces backend")
    args = p.parse_args()
    args.pieces = [int(k) for k in args.pieces.split(",")]
    ps = tpflash.parallel.init(tp=int(os.environ.get("WORLD_SIZE", "1")))
    if ps.device.type != "cuda" or ps.tp_size < 2:
        raise SystemExit("bench_overlap needs >= 2 GPUs under torchrun")
    table = []
    for name in args.models.split(","):
        table += bench_model(name, MODELS[name], args, ps)
    if ps.rank == 0:
        print(f"\n{torch.cuda.get_device_name()} x{ps.tp_size}, torch {torch.__version__}, "
              f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}, "
              f"seq {args.seq} x batch {args.batch}, MLP fwd+bwd (bf16 autocast)")
        print("| model | path | ms | exposed ms |\n|---|---|---:|---:|")
        for name, label, ms, exposed in table:
            print(f"| {name} | {label} | {ms:.3f} | {exposed:.3f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
