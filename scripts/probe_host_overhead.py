"""Host time per call of tpflash's layers and kernels against their PyTorch twins, on one GPU.

An eager training step is bound by the host wherever the host takes longer to issue an op than
the GPU takes to run it. This times the issuing alone: tiny tensors (the GPU finishes each kernel
in a few microseconds), many calls, one sync at the end, microseconds per call. Forward only and
forward + backward, under bf16 autocast as the training step runs.

    python3 scripts/probe_host_overhead.py [--calls 300]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tpflash import kernels
from tpflash.layers.autocast_linear import linear, linears
from tpflash.layers.block import ParallelTransformerBlock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_peers import Block  # noqa: E402

DEV = "cuda"


@triton.jit
def _noop_kernel(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    sync()
    return 1e6 * host / calls


def cases(d: int, tokens: int):
    x = torch.randn(tokens, 1, d, device=DEV, requires_grad=True)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    w = torch.ones(d, device=DEV, requires_grad=True)
    b = torch.zeros(d, device=DEV, requires_grad=True)
    ws = [torch.randn(d, d, device=DEV, requires_grad=True) for _ in range(3)]
    bs = [torch.zeros(d, device=DEV, requires_grad=True) for _ in range(3)]
    q = torch.randn(1, tokens, 4, d // 4, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    block = ParallelTransformerBlock(d, 4, device=DEV)
    scratch = torch.zeros(1024, device=DEV)
    yield "triton no-op kernel launch", lambda: _noop_kernel[(1,)](scratch, 1024, BLOCK=1024), None
    yield "empty tensor", lambda: torch.empty(16, device=DEV), None
    yield "tpflash layer_norm (Triton)", lambda: kernels.layer_norm(x, w, b), lambda o: o
    yield "tpflash layer_norm + residual", lambda: kernels.layer_norm(xb, w, b, residual=x, out_dtype=torch.bfloat16), lambda o: o[0].float() + o[1]
    yield "F.layer_norm", lambda: F.layer_norm(x, (d,), w, b), lambda o: o
    yield "tpflash linear", lambda: linear(x, ws[0], bs[0]), lambda o: o
    yield "F.linear", lambda: F.linear(x, ws[0], bs[0]), lambda o: o
    yield "tpflash linears (q/k/v)", lambda: linears(x, ws, bs), lambda o: o[0] + o[1] + o[2]
    yield "3 x F.linear", lambda: [F.linear(x, wi, bi) for wi, bi in zip(ws, bs)], lambda o: o[0] + o[1] + o[2]
    yield "tpflash flash_attention (cuDNN)", lambda: kernels.flash_attention(q, q, q, causal=True), lambda o: o
    yield "F.scaled_dot_product_attention", lambda: F.scaled_dot_product_attention(
        q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True), lambda o: o
    plain_block = Block(d, 4).to(DEV)
    yield "tpflash transformer block", lambda: block(x), lambda o: o[0].float() + o[1]
    xp = x.detach().transpose(0, 1).contiguous().requires_grad_()  # [batch, seq, d]
    yield "plain block (nn.Linear, SDPA)", lambda: plain_block(xp), lambda o: o


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--cprofile", default="", metavar="SUBSTRING",
                   help="also run cProfile over forward + backward of the cases whose name contains this")
    p.add_argument("--cprofile-pass", choices=("forward", "both"), default="both",
                   help="with --cprofile: profile the forward alone, or forward + backward (default)")
    p.add_argument("--cprofile-top", type=int, default=25, metavar="N", help="with --cprofile: rows printed")
    p.add_argument("--device", default="cuda", help="cpu (under TRITON_INTERPRET=1) only checks that it runs")
    args = p.parse_args()
    global DEV
    DEV = args.device
    where = torch.cuda.get_device_name() if DEV == "cuda" else "cpu: not a measurement"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {where}")
    profiles = []
    print("| op | forward us/call | forward + backward us/call |\n|---|---:|---:|")
    for name, fwd, to_loss in cases(args.d, args.tokens):
        with torch.autocast(DEV, dtype=torch.bfloat16):
            f_us = per_call_us(fwd, args.calls)
        fb = "-"
        if to_loss is not None:
            def step(fwd=fwd, to_loss=to_loss):
                with torch.autocast(DEV, dtype=torch.bfloat16):
                    out = to_loss(fwd())
                out.float().sum().backward()
            fb = f"{per_call_us(step, args.calls // 3):.0f}"
            if args.cprofile and args.cprofile in name:
                profiles.append((name, step if args.cprofile_pass == "both" else fwd))
        print(f"| {name} | {f_us:.0f} | {fb} |")
    for name, step in profiles:
        what = "forward + backward" if args.cprofile_pass == "both" else "forward"
        print(f"\n== cProfile, {what} of {name}, {args.calls} calls")
        prof = cProfile.Profile()
        with torch.autograd.set_multithreading_enabled(False), torch.autocast(DEV, dtype=torch.bfloat16):
            prof.runcall(lambda: [step() for _ in range(args.calls)])  # backward on this thread, where cProfile looks
        stats = pstats.Stats(prof)
        print(f"{stats.total_calls / args.calls:.0f} Python calls per call")
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(args.cprofile_top)


if __name__ == "__main__":
    main()
