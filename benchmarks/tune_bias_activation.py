"""Sweep the launch of the bias + GELU kernel (and of the concatenation that shares its backward
rule) on one GPU and print the fastest launches per shape.

The launch (tile rows and columns, warps, programs per SM, pipeline stages) is a fixed rule in
tpflash/kernels/bias_activation_kernel.py (LAUNCH), not an autotuner: the bias gradient's bits depend
on the row splits, and tp ranks must agree. Shapes: gpt-2.7b's at tp 1, 2 and 4, 8192 tokens, bf16:
the MLP activations [8192, 10240 | 5120 | 2560] (the forward and the backward with its bias
gradient), and the stacked q/k/v gradient, 3 x [2048, 4, 2560 | 1280 | 640] views of the attention's
[4, 2048, c] gradients (concat_with_column_sum, the backward's rule). Times are us per call in a CUDA
graph over 4 inputs (read from HBM), beside the unfused peers.

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
from tpflash.kernels.concat_sum_kernel import triton_concat_with_column_sum

DEV, BF16 = "cuda", torch.bfloat16
TILES = {False: [(1, 1024), (2, 1024), (4, 1024), (8, 512), (16, 256)],
         True: [(32, 64), (64, 64), (16, 128), (32, 128), (64, 128), (16, 256)]}
WARPS = {False: (4, 8), True: (4, 8)}
PER_SM = {False: (8, 32, 4096), True: (1, 2, 4, 8, 32)}  # 4096: one tile per program


def timed(fn, xs) -> float:
    fn(*xs[0])  # compile outside the graph
    return 1e3 * do_bench_cudagraph(lambda: [fn(*x) for x in xs]) / len(xs)  # us per call


def sweep(title: str, backward: bool, fn, xs, peer: float, gb: float, top: int) -> None:
    """Time fn(*x, launch=...) for every candidate launch of the direction; print the fastest."""
    results = []
    for (rows, block_c), warps, per_sm, stages in itertools.product(
            TILES[backward], WARPS[backward], PER_SM[backward], (1, 3)):
        launch = {"BLOCK_R": rows, "BLOCK_C": block_c, "WARPS": warps, "PER_SM": per_sm, "STAGES": stages}
        try:
            results.append((timed(lambda *x: fn(*x, launch=launch), xs), launch))
        except Exception as exc:  # a launch the GPU cannot run (registers, shared memory)
            print(f"  skip {launch}: {type(exc).__name__}")
    results.sort(key=lambda r: r[0])
    current = next((us for us, launch in results if launch == LAUNCH[backward]), float("nan"))
    print(f"{title}: unfused peer {peer:.1f} us, current {current:.1f} us")
    for us, launch in results[:top]:
        print(f"  {us:7.1f} us  {gb / us:6.0f} GB/s  {launch}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; current LAUNCH {LAUNCH}")
    for cols in (10240, 5120, 2560):
        ys = [torch.randn(8192, cols, device=DEV, dtype=BF16) for _ in range(4)]
        dhs = [torch.randn_like(y) for y in ys]
        b = torch.randn(cols, device=DEV)
        for backward in (False, True):
            xs = list(zip(ys, dhs)) if backward else [(y,) for y in ys]
            if backward:
                peer = timed(lambda y, dh: column_sum(torch.ops.aten.gelu_backward(dh, y, approximate="tanh")), xs)
            else:
                peer = timed(lambda y: F.gelu(y, approximate="tanh"), xs)
            gb = (3 if backward else 2) * ys[0].numel() * 2 / 1e3
            sweep(f"[8192, {cols}] {'backward' if backward else 'forward'}", backward,
                  lambda y, dh=None, launch=None: triton_bias_activation(y, b, "gelu", dh=dh, launch=launch),
                  xs, peer, gb, args.top)
    for c in (2560, 1280, 640):
        # [s, b, c] views of [b, s, c] memory, as the attention's q/k/v gradients arrive
        xs = [([torch.randn(4, 2048, c, device=DEV, dtype=BF16).transpose(0, 1) for _ in range(3)],)
              for _ in range(4)]
        peer = timed(lambda parts: column_sum(torch.cat(parts, -1).view(-1, 3 * c)), xs)
        sweep(f"concat 3 x [2048, 4, {c}]", True,
              lambda parts, launch=None: triton_concat_with_column_sum(parts, launch=launch),
              xs, peer, 2 * 3 * 8192 * c * 2 / 1e3, args.top)


if __name__ == "__main__":
    main()
