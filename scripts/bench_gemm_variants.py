"""Which cuBLAS call is fastest for each GEMM of a block, on one GPU: the variants tpflash could run.

    PYTHONPATH=$PWD python3 scripts/bench_gemm_variants.py [--models gpt-1.3b,gpt-2.7b] [--tp 1] [--rounds 3]
        [--tokens 8192]     (the copy-engine overlap at tp=2 multiplies one rank's rows at a time: --tokens 4096)

For each forward product of one block's layers (--tokens rows, default 4 x 2048, bf16, inside a CUDA graph) it
times: `mm` (no bias: what runs when the bias is added by a later kernel), `addmm` with the bias in
cuBLAS's epilogue, and `addmm` with a zero bias (same bits as mm: only the kernel choice differs).
For the q/k/v and up/gate weights: one GEMM over the stacked weights against one per weight.
For weight gradients: fp32 output from the GEMM (tpflash) against bf16 output plus a cast (autocast).
Variants alternate over --rounds rounds, and each cell is the median, because an H100 running
GEMMs back to back sits at its power cap and its clock drifts between runs.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench_cudagraph

BF16, F32 = torch.bfloat16, torch.float32
MODELS = {"gpt-1.3b": (2048, 8192), "gpt-2.7b": (2560, 10240)}  # hidden, ffn


def us(fn) -> float:
    return 1000 * do_bench_cudagraph(fn, rep=60)


def forward_variants(m: int, k: int, n: int, stacked: int):
    """{variant: fn} for x [m, k] @ W^T, W [n, k] (n the sum over `stacked` weights)."""
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) / k ** 0.5
    b, zero = torch.randn(n, device="cuda", dtype=BF16), torch.zeros(n, device="cuda", dtype=BF16)
    out = {"mm": lambda: torch.mm(x, w.t()), "addmm bias": lambda: torch.addmm(b, x, w.t()),
           "addmm zero": lambda: torch.addmm(zero, x, w.t())}
    if stacked > 1:
        parts, bparts = w.chunk(stacked), b.chunk(stacked)
        out["per weight, bias"] = lambda: [torch.addmm(bi, x, wi.t()) for wi, bi in zip(parts, bparts)]
        out["per weight, mm"] = lambda: [torch.mm(x, wi.t()) for wi in parts]
    return out


def backward_variants(m: int, k: int, n: int):
    """{variant: fn} for the input and weight gradients of y = x W^T, x [m, k], W [n, k]."""
    g = torch.randn(m, n, device="cuda", dtype=BF16)
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16)
    return {"dgrad": lambda: torch.mm(g, w),
            "wgrad fp32 out": lambda: torch.mm(g.t(), x, out_dtype=F32),
            "wgrad bf16 + cast": lambda: torch.mm(g.t(), x).float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-1.3b,gpt-2.7b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4 * 2048, help="rows of every product")
    args = ap.parse_args()
    tokens = args.tokens
    tp = args.tp
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, tp={tp}, tokens={tokens}")
    for model in args.models.split(","):
        h, ffn = MODELS[model]
        shapes = {"qkv": (h, 3 * h // tp, 3), "o": (h // tp, h, 1), "up": (h, ffn // tp, 1),
                  "down": (ffn // tp, h, 1)}  # name: (k, n, stacked)
        print(f"\n| {model} | GEMM | m x k x n | variant | us (median of {args.rounds}) | all rounds |")
        print("|---|---|---|---|---:|---|")
        for name, (k, n, stacked) in shapes.items():
            variants = {**forward_variants(tokens, k, n, stacked), **backward_variants(tokens, k, n)}
            times = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, fn in variants.items():
                    times[v].append(us(fn))
            for v, ts in times.items():
                cells = " / ".join(f"{t:.1f}" for t in ts)
                print(f"| {model} | {name} | {tokens}x{k}x{n} | {v} | {statistics.median(ts):.1f} | {cells} |",
                      flush=True)


if __name__ == "__main__":
    main()
