"""How fast can a rank pull its peer's activation shard over NVLink, and what does it cost a GEMM?

    torchrun --nproc_per_node=2 scripts/probe_copy_engines.py [--mib 21]

Every rank pulls its peer's shard out of a symmetric-memory buffer at the same time (the pattern
of tpflash.parallel.peer_collectives' all-gather), as one copy_ or split into c chunks on c streams
(does more than one copy engine help?), by an SM kernel instead of a copy_, and pushes instead of
pulls; then the device barrier alone; then a gpt-2.7b tp=2 q/k/v GEMM alone and beside each
transfer. Prints one line per case from rank 0 (ms per transfer, GiB/s one way).
"""
import argparse

import torch
import torch.distributed as dist


def _time(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=21)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    from torch.distributed import _symmetric_memory as symm
    from tpflash.parallel.symm_overlap import _group_name
    group = dist.group.WORLD
    n = args.mib << 20
    buf = symm.empty(2 * n, dtype=torch.uint8, device="cuda")
    handle = symm.rendezvous(buf, _group_name(group))
    peer = (rank + 1) % world
    src = handle.get_buffer(peer, (n,), torch.uint8, 0)   # the peer's shard, mapped here
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    push_dst = handle.get_buffer(peer, (n,), torch.uint8, n)
    local = torch.empty(n, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(8)]
    gib = n / 2**30

    def chunked(c, a, b):
        def run():
            cur = torch.cuda.current_stream()
            for s, (x, y) in zip(streams[:c], zip(b.chunk(c), a.chunk(c))):
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    x.copy_(y)
            for s in streams[:c]:
                cur.wait_stream(s)
        return run

    def report(name, ms):
        if rank == 0:
            print(f"[copy] {name:<44} {ms:7.3f} ms  {gib / ms * 1e3:7.1f} GiB/s", flush=True)

    cases = {f"pull, {c} chunk(s) on {c} stream(s)": chunked(c, src, dst) for c in (1, 2, 4, 8)}
    cases["pull, 4 chunks on one stream"] = lambda: [y.copy_(x) for x, y in zip(src.chunk(4), dst.chunk(4))]
    cases["push, 1 chunk"] = chunked(1, local, push_dst)
    cases["push, 4 chunks on 4 streams"] = chunked(4, local, push_dst)
    src16, dst16 = src.view(torch.bfloat16), dst.view(torch.bfloat16)
    cases["pull by an SM kernel (torch.mul(src, 1))"] = lambda: torch.mul(src16, 1, out=dst16)
    cases["local copy_ (staging)"] = lambda: dst.copy_(local)
    for name, fn in cases.items():
        report(name, _time(fn))
    ms = _time(lambda: handle.barrier(channel=0), iters=200)
    if rank == 0:
        print(f"[copy] barrier alone {ms * 1e3:.1f} us", flush=True)

    x = torch.randn(8192, 2560, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2560, 3840, device="cuda", dtype=torch.bfloat16)
    gemm_ms = _time(lambda: x @ w)
    if rank == 0:
        print(f"[gemm] [8192x2560]x[2560x3840] alone {gemm_ms:.3f} ms", flush=True)
    side = torch.cuda.Stream()
    for name in ("pull, 1 chunk(s) on 1 stream(s)", "pull, 4 chunk(s) on 4 stream(s)",
                 "pull by an SM kernel (torch.mul(src, 1))"):
        fn = cases[name]

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            x @ w
            torch.cuda.current_stream().wait_stream(side)
        ms = _time(both)
        if rank == 0:
            print(f"[gemm] GEMM beside '{name}': {ms:.3f} ms (GEMM alone {gemm_ms:.3f})", flush=True)

    q = torch.randn(2048, 4, 3 * 2048, device="cuda", dtype=torch.bfloat16)
    qv = q[..., :2048].view(2048, 4, 16, 128).permute(1, 2, 0, 3)  # [b, h, s, d] view of [s, b, 3hd]
    out = torch.nn.functional.scaled_dot_product_attention(qv, qv, qv, is_causal=True)
    if rank == 0:
        print(f"[sdpa] q strides {qv.stride()} -> out strides {out.stride()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
