"""Sequence-parallel collectives on NVLink: NCCL versus copy-engine transfers through symmetric memory.

Times, for one [seq/tp, batch, d] bf16 activation of the gpt-1.3b and gpt-2.7b shapes:
  nccl        all_gather_into_tensor / reduce_scatter_tensor (tpflash's eager collectives)
  copy-engine tpflash.parallel.peer_collectives (peer buffers copied by the copy engines; the
              reduce-scatter's sum is one small SM kernel)
and whether each slows a concurrent GEMM (the backward's weight-gradient GEMM) when it runs on a
side stream: NCCL's kernels occupy SMs, copy-engine transfers do not.

    torchrun --nproc_per_node=2 benchmarks/collectives.py   (CUDA, 2+ GPUs)
"""
from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpflash.parallel import comm, peer_collectives  # noqa: E402

SHAPES = {"gpt-1.3b": (2048, 4, 2048), "gpt-2.7b": (2048, 4, 2560)}  # seq, batch, d


def median_ms(fn, reps: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    group = dist.new_group(list(range(world)))
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    rows = []
    for name, (seq, batch, d) in SHAPES.items():
        shard = torch.randn(seq // world, batch, d, device=dev, dtype=torch.bfloat16)
        full = torch.randn(seq, batch, d, device=dev, dtype=torch.bfloat16)
        # correctness first: the copy-engine results must equal NCCL's
        ag_ok = torch.equal(comm.all_gather(shard, 0, group), peer_collectives.all_gather(shard, group))
        rs_n, rs_p = comm.reduce_scatter(full, 0, group), peer_collectives.reduce_scatter(full, group)
        rs_err = (rs_n.float() - rs_p.float()).abs().max().item()
        mb = shard.numel() * shard.element_size() / 2**20
        ag_nccl = median_ms(lambda: comm.all_gather(shard, 0, group))
        rs_nccl = median_ms(lambda: comm.reduce_scatter(full, 0, group))
        ag_ce = median_ms(lambda: peer_collectives.all_gather(shard, group))
        rs_ce = median_ms(lambda: peer_collectives.reduce_scatter(full, group))
        # dW = grad_y^T x for an MLP up-projection: [4d/tp, seq*batch] @ [seq*batch, d]
        gy = torch.randn(seq * batch, 4 * d // world, device=dev, dtype=torch.bfloat16)
        x = torch.randn(seq * batch, d, device=dev, dtype=torch.bfloat16)
        gemm = lambda: gy.t() @ x  # noqa: E731

        def beside(collective):
            def run():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    collective()
                gemm()
                torch.cuda.current_stream().wait_stream(side)
            return run

        g_alone = median_ms(gemm)
        g_nccl = median_ms(beside(lambda: comm.all_gather(shard, 0, group)))
        g_ce = median_ms(beside(lambda: peer_collectives.all_gather(shard, group)))
        rows.append((name, mb, ag_ok, rs_err, ag_nccl, ag_ce, rs_nccl, rs_ce, g_alone, g_nccl, g_ce))
    if rank == 0:
        print(f"{torch.cuda.get_device_name()} x {world}, torch {torch.__version__}")
        print("| shape | shard MiB | AG equal | RS max err | AG nccl ms | AG copy-engine ms | RS nccl ms | "
              "RS copy-engine ms | dW GEMM alone | GEMM + nccl AG | GEMM + copy-engine AG |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r[0]} | {r[1]:.0f} | {r[2]} | {r[3]:.3g} | " + " | ".join(f"{v:.3f}" for v in r[4:]) + " |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
