"""Sweep the launch of the Triton norm backward on one GPU and print the fastest launches per shape.

The backward's launch (tile rows, pipeline stages, warps, programs per SM) is a fixed rule in
tpflash/kernels/norm_kernels.py (BWD_DEFAULT / _bwd_launch), not an autotuner, because tp ranks
must compute the same bits; this script is how that rule is chosen. Shapes: the kernel benchmark's
bf16 [16384, 4096] LayerNorm/RMSNorm, and the blocks' own case under autocast (fp32 residual
stream h and dresidual, bf16 dy, fp32 dx) at gpt-1.3b's and gpt-2.7b's hidden sizes.

    python3 benchmarks/tune_norm_bwd.py [--quick]
GB/s counts the bytes the backward must move once: h, dy (and dresidual) read, dx written.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import triton

from tpflash.kernels.norm_kernels import _bwd_launch, _launch_shape, _norm_backward

DEV = "cuda"
CASES = [  # name, rows, n, h dtype, dy dtype, has dres, rms
    ("layernorm bf16", 16384, 4096, torch.bfloat16, torch.bfloat16, False, False),
    ("rmsnorm bf16", 16384, 4096, torch.bfloat16, torch.bfloat16, False, True),
    ("block LN n2048 fp32 h, bf16 dy, dres", 8192, 2048, torch.float32, torch.bfloat16, True, False),
    ("block LN n2560 fp32 h, bf16 dy, dres", 8192, 2560, torch.float32, torch.bfloat16, True, False),
]


def inputs(rows, n, h_dtype, dy_dtype, has_dres, rms):
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(rows, n, device=DEV, generator=g).to(h_dtype)
    dy = torch.randn(rows, n, device=DEV, generator=g).to(dy_dtype)
    dres = torch.randn(rows, n, device=DEV, generator=g).to(h_dtype) if has_dres else None
    w = torch.rand(n, device=DEV, generator=g) + 0.5
    b = None if rms else torch.randn(n, device=DEV, generator=g)
    hf = h.float()
    mean = hf.mean(1)
    var = hf.square().mean(1) if rms else (hf - mean[:, None]).square().mean(1)
    rstd = torch.rsqrt(var + 1e-5)
    return h, w, b, dy, dres, mean, rstd


def copy_gbs() -> float:
    a = torch.empty(2**28, device=DEV, dtype=torch.float32)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / triton.testing.do_bench(lambda: b.copy_(a), rep=100) / 1e6


def sweep(case, grid, copy):
    name, rows, n, h_dtype, dy_dtype, has_dres, rms = case
    h, w, b, dy, dres, mean, rstd = inputs(rows, n, h_dtype, dy_dtype, has_dres, rms)
    nbytes = rows * n * (2 * h.element_size() + dy.element_size() + (h.element_size() if has_dres else 0))
    run = lambda launch: _norm_backward(h, w, b, dy, dres, mean, rstd, rms, h.dtype, launch)  # noqa: E731
    rule = _bwd_launch(_launch_shape(n)[0], {"H": h, "DY": dy, "DRES": dres}, has_dres)
    ref = run(rule)
    results = []
    for rows_, stages, warps, per_sm in grid:
        launch = {"ROWS": rows_, "STAGES": stages, "WARPS": warps, "PER_SM": per_sm}
        try:
            out = run(launch)
            if not torch.allclose(out[0].float(), ref[0].float(), rtol=2e-2, atol=2e-2):
                print(f"  {launch}: dx differs from the rule's launch", flush=True)
                continue
            ms = triton.testing.do_bench(lambda: run(launch), warmup=5, rep=25)
        except Exception as e:  # out of resources: not a candidate
            print(f"  {launch}: {type(e).__name__}", flush=True)
            continue
        results.append((nbytes / ms / 1e6, launch))
    rule_gbs = nbytes / triton.testing.do_bench(lambda: run(rule), rep=50) / 1e6
    results.sort(key=lambda r: -r[0])
    print(f"\n== {name}: [{rows}, {n}]; copy {copy:.0f} GB/s; current rule {rule} -> {rule_gbs:.0f} GB/s "
          f"({rule_gbs / copy:.0%})")
    for gbs, launch in results[:10]:
        print(f"  {gbs:7.0f} GB/s  {gbs / copy:4.0%}  {launch}")
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    args = p.parse_args()
    if args.quick:
        grid = list(itertools.product([1, 2], [1, 3], [4, 8, 16], [2, 4]))
    else:
        grid = list(itertools.product([1, 2, 4], [1, 3], [4, 8, 16], [1, 2, 4, 8]))
    copy = copy_gbs()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{len(grid)} launches per shape", flush=True)
    for case in CASES:
        sweep(case, grid, copy)


if __name__ == "__main__":
    main()
