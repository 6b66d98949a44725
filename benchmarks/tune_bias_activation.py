"""Sweep the launch of the bias + GELU kernel on one GPU and print the fastest launches per shape.

The launch (tile rows and columns, warps, programs per SM) is a fixed rule in
tpflash/kernels/bias_activation_kernel.py (LAUNCH), not an autotuner: the bias gradient's bits depend
on the row splits, and tp ranks must agree. Shapes: the MLP activations of gpt-1.3b (tp=1: 8192
columns), gpt-2.7b (tp=1: 10240, tp=2: 5120), 8192 tokens, bf16. Times are in a CUDA graph over 4
matrices (read from HBM), beside the unfused peers: F.gelu, and gelu_backward + column_sum.

    python3 benchmarks/tune_bias_activation.py [--top 5]
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from tpflash.kernels import column_sum
from tpflash.kernels.bias_activation_kernel import LAUNCH, triton_bias_activation

DEV, BF16 = "cuda", torch.bfloat16
TILES = {False: [(1, 1024), (2, 1024), (4, 1024), (8, 512), (16, 256)],
         True: [(32, 32), (128, 32), (16, 64), (32, 64), (64, 64), (32, 128), (4, 512)]}
WARPS = {False: (4, 8), True: (8,)}
PER_SM = {False: (8, 32, 4096), True: (4, 8, 16, 32)}  # 4096: one tile per program


def timed(fn, xs) -> float:
    fn(*xs[0])  # compile outside the graph
    return 1e3 * do_bench_cudagraph(lambda: [fn(*x) for x in xs]) / len(xs)  # us per matrix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; current LAUNCH {LAUNCH}")
    for cols in (8192, 10240, 5120):
        ys = [torch.randn(8192, cols, device=DEV, dtype=BF16) for _ in range(4)]
        dhs = [torch.randn_like(y) for y in ys]
        b = torch.randn(cols, device=DEV)
        for backward in (False, True):
            xs = list(zip(ys, dhs)) if backward else [(y,) for y in ys]
            if backward:
                peer = timed(lambda y, dh: column_sum(torch.ops.aten.gelu_backward(dh, y, approximate="tanh")), xs)
            else:
                peer = timed(lambda y: F.gelu(y, approximate="tanh"), xs)
            results = []
            for (rows, block_c), warps, per_sm, stages in itertools.product(
                    TILES[backward], WARPS[backward], PER_SM[backward], (1, 3)):
                launch = {"BLOCK_R": rows, "BLOCK_C": block_c, "WARPS": warps, "PER_SM": per_sm, "STAGES": stages}
                try:
                    us = timed(lambda y, dh=None: triton_bias_activation(y, b, "gelu", dh=dh, launch=launch), xs)
                except Exception as exc:  # a launch the GPU cannot run (registers, shared memory)
                    print(f"  skip {launch}: {type(exc).__name__}")
                    continue
                results.append((us, launch))
            results.sort(key=lambda r: r[0])
            current = next((us for us, launch in results if launch == LAUNCH[backward]), float("nan"))
            gb = (3 if backward else 2) * ys[0].numel() * 2 / 1e3
            print(f"[8192, {cols}] {'backward' if backward else 'forward'}: unfused peer {peer:.1f} us, "
                  f"current {current:.1f} us")
            for us, launch in results[:args.top]:
                print(f"  {us:7.1f} us  {gb / us:6.0f} GB/s  {launch}")


if __name__ == "__main__":
    main()
