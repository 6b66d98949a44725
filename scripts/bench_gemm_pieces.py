"""What splitting a tp=2 layer's GEMMs into per-rank pieces costs on its own, on one GPU, no transfers.

    PYTHONPATH=$PWD python3 scripts/bench_gemm_pieces.py [--models gpt-2.7b,gpt-1.3b] [--tp 2]

The copy-engine overlap (tpflash.parallel.peer_overlap) multiplies one rank's rows at a time, and
sends each peer's rows in SEND_CHUNKS GEMMs. For each GEMM of one block at the given tp, this
prints the time (us, bf16, inside a CUDA graph) of: the whole GEMM; the same in one GEMM per rank
("by rank"); and per rank with each peer's rows in 2 chunks ("chunked", what the row forward and
the column backward run). Weight gradients: one GEMM over all tokens against a sum of one fp32
GEMM per rank's tokens. The block's total at the bottom; its last column adds each GEMM as the
overlap runs it (row forward and column backward chunked, the rest by rank).
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench_cudagraph

BF16, F32 = torch.bfloat16, torch.float32
MODELS = {"gpt-1.3b": (2048, 8192), "gpt-2.7b": (2560, 10240)}  # hidden, ffn
TOKENS = 4 * 2048


def us(fn) -> float:
    return 1000 * do_bench_cudagraph(fn, rep=100)


def row_splits(m: int, tp: int, chunks: int):
    """Row slices of [m] as the overlap runs them: this rank's block whole, each peer's in `chunks`."""
    block = m // tp
    out = [slice(0, block)]
    for r in range(1, tp):
        bounds = [r * block + block * i // chunks for i in range(chunks + 1)]
        out += [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    return out


def bench_product(m: int, k: int, n: int, tp: int):
    """(whole, by rank, chunked) us of [m, k] @ [k, n] into one [m, n] output."""
    a = torch.randn(m, k, device="cuda", dtype=BF16)
    b = torch.randn(n, k, device="cuda", dtype=BF16).t()
    out = torch.empty(m, n, device="cuda", dtype=BF16)

    def pieces(slices):
        def run():
            for s in slices:
                torch.mm(a[s], b, out=out[s])
        return run
    return (us(pieces([slice(0, m)])), us(pieces(row_splits(m, tp, 1))), us(pieces(row_splits(m, tp, 2))))


def bench_weight_grad(m: int, n_out: int, k_in: int, tp: int):
    """(whole, by rank) us of grad_y^T x in fp32: [m, n_out]^T [m, k_in], summed over tp row blocks."""
    g = torch.randn(m, n_out, device="cuda", dtype=BF16)
    x = torch.randn(m, k_in, device="cuda", dtype=BF16)
    block = m // tp

    def whole():
        torch.mm(g.t(), x, out_dtype=F32)

    def by_rank():
        into = torch.mm(g[:block].t(), x[:block], out_dtype=F32)
        for r in range(1, tp):
            rows = slice(r * block, (r + 1) * block)
            torch.addmm(into, g[rows].t(), x[rows], out_dtype=F32, out=into)
    return us(whole), us(by_rank)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-2.7b,gpt-1.3b")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    tp = args.tp
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, tp={tp}, tokens={TOKENS}")
    for model in args.models.split(","):
        h, ffn = MODELS[model]
        print(f"\n{model} | GEMM | m x k x n | whole us | by rank us | chunked us")
        print("|---|---|---|---:|---:|---:|")
        products = {  # name: (m, k, n)
            "qkv fwd": (TOKENS, h, 3 * h // tp), "o fwd": (TOKENS, h // tp, h),
            "up fwd": (TOKENS, h, ffn // tp), "down fwd": (TOKENS, ffn // tp, h),
            "qkv dgrad": (TOKENS, 3 * h // tp, h), "o dgrad": (TOKENS, h, h // tp),
            "up dgrad": (TOKENS, ffn // tp, h), "down dgrad": (TOKENS, h, ffn // tp),
        }
        chunked_when_run = {"o fwd", "down fwd", "qkv dgrad", "up dgrad"}  # the sends; the others consume a gather
        totals = [0.0, 0.0, 0.0]  # whole, by rank, as the overlap runs them
        for name, (m, k, n) in products.items():
            t = bench_product(m, k, n, tp)
            totals = [totals[0] + t[0], totals[1] + t[1], totals[2] + (t[2] if name in chunked_when_run else t[1])]
            print(f"| {model} | {name} | {m}x{k}x{n} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} |", flush=True)
        grads = {"qkv wgrad": (3 * h // tp, h), "o wgrad": (h, h // tp), "up wgrad": (ffn // tp, h),
                 "down wgrad": (h, ffn // tp)}
        for name, (n_out, k_in) in grads.items():
            t = bench_weight_grad(TOKENS, n_out, k_in, tp)
            totals = [totals[0] + t[0], totals[1] + t[1], totals[2] + t[1]]
            print(f"| {model} | {name} | {TOKENS}x{n_out}x{k_in} | {t[0]:.1f} | {t[1]:.1f} | |", flush=True)
        print(f"| {model} | **block total** (last column: as the overlap runs them) | | {totals[0]:.1f} | "
              f"{totals[1]:.1f} | {totals[2]:.1f} |")


if __name__ == "__main__":
    main()
