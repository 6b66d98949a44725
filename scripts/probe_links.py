"""How fast the GPUs of this machine talk: peer access, a device-to-device copy, NCCL collectives.

    python3 scripts/probe_links.py                    # one process: peer access and cross-GPU copy_
    torchrun --nproc_per_node=2 scripts/probe_links.py --nccl   # all-gather / reduce-scatter bus bandwidth
Run with NCCL_DEBUG=INFO to see the transport NCCL picked (P2P/CUMEM, P2P/IPC or SHM).
"""
import argparse
import sys

import torch
import torch.distributed as dist


def _ms(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def peer_copy():
    n = torch.cuda.device_count()
    print(f"{n} GPUs; peer access 0->1: {n > 1 and torch.cuda.can_device_access_peer(0, 1)}")
    if n < 2:
        return
    for mb in (21, 256):
        a = torch.empty(mb << 20, dtype=torch.uint8, device="cuda:0")
        b = torch.empty_like(a, device="cuda:1")
        ms = _ms(lambda: b.copy_(a, non_blocking=True))
        print(f"copy_ cuda:0 -> cuda:1 {mb} MiB: {ms:.3f} ms, {mb / 1024 / ms * 1e3:.1f} GiB/s")


def nccl():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    for mb in (1, 21, 256):
        out = torch.empty(mb << 20, dtype=torch.uint8, device="cuda")
        inp = out[: out.numel() // world]
        ag = _ms(lambda: dist.all_gather_into_tensor(out, inp))
        rs_in = torch.empty(mb << 19, dtype=torch.bfloat16, device="cuda")
        rs_out = rs_in[: rs_in.numel() // world].clone()
        rs = _ms(lambda: dist.reduce_scatter_tensor(rs_out, rs_in))
        bus = (world - 1) / world * (mb / 1024)  # GiB each rank sends
        if rank == 0:
            print(f"NCCL {mb} MiB: all-gather {ag:.3f} ms ({bus / ag * 1e3:.1f} GiB/s bus), "
                  f"reduce-scatter {rs:.3f} ms ({bus / rs * 1e3:.1f} GiB/s bus)")
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nccl", action="store_true")
    sys.exit(nccl() if p.parse_args().nccl else peer_copy())
