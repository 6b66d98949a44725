"""The fp8 casts of the fp8 linear layers (one GPU): tpflash's fused Triton casts
(tpflash.kernels.fp8.cast) against eager `quantize` and torch.compile of it, in GB/s beside the
device's copy bandwidth, and one markdown table at the end.

Casts, each as tpflash.layers.fp8_linear uses it, of a bf16 x [M, K] to e4m3:
  rowwise     one scale per row, x8 row-major (x and W in the forward, dY for dX)
  column      one scale per column, x8 column-major (W for dX, dY and x for dW under "rowwise")
  tensorwise  one scale, x8 row-major and column-major (x, W and dY under "tensorwise"; one read)
  given amax  one given scale, x8 row-major (x under sequence parallelism: the amax reduced over tp)
The peers do what the layer did before the fused casts: `quantize`, plus the copy into the column-major
layout that scaled_mm then made (`.t().contiguous().t()`). GB/s = (bytes of x read once + bytes of x8
and scales written once) / median time (triton.testing.do_bench, which flushes the L2 before each
run); "of copy" divides by a 1 GiB device copy's bandwidth (bytes read + written). A cast that must
take the amax first reads x twice, so its ceiling is below the copy bandwidth: 60% of it for column
(bf16 2 + 2 bytes read, 1 written per element against 3 counted), 67% for tensorwise (2 + 2 + 2 against 4).

    python benchmarks/fp8_cast.py [--shapes 8192x2048 8192x5632 16384x4096] [--no-compile]
    TRITON_INTERPRET=1 python benchmarks/fp8_cast.py --device cpu --shapes 24x40 --no-compile --reps 1
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tpflash.kernels import use_backend
from tpflash.kernels.dispatch import interpreting
from tpflash.kernels.fp8 import E4M3, cast, quantize, tensor_amax

CASTS = ("rowwise", "column", "tensorwise", "given amax")


def _col_major(t):
    return t.t().contiguous().t()


def eager(kind):
    """The layer's cast before the fused kernels: quantize, and scaled_mm's copy to column-major."""
    if kind == "rowwise":
        return lambda x, amax: quantize(x, E4M3, -1)
    if kind == "column":
        return lambda x, amax: (lambda x8, s: (_col_major(x8), s))(*quantize(x, E4M3, 0))
    if kind == "tensorwise":
        return lambda x, amax: (lambda x8, s: (x8, _col_major(x8), s))(*quantize(x, E4M3, None))
    return lambda x, amax: quantize(x, E4M3, None, amax)


def fused(kind):
    return {"rowwise": lambda x, amax: cast(x, E4M3, -1),
            "column": lambda x, amax: cast(x, E4M3, 0, row=False, col=True),
            "tensorwise": lambda x, amax: cast(x, E4M3, None, row=True, col=True),
            "given amax": lambda x, amax: cast(x, E4M3, None, amax)}[kind]


def bytes_moved(kind, x):
    """x read once, each fp8 layout written once, the fp32 scales written once."""
    m, k = x.shape
    layouts = 2 if kind == "tensorwise" else 1
    scales = {"rowwise": m, "column": k}.get(kind, 1)
    return x.numel() * x.element_size() + layouts * x.numel() + 4 * scales


def timer(device, reps):
    if device == "cuda":
        from triton.testing import do_bench
        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_ms(fn):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    return cpu_ms


def copy_gbs(device, ms_of):
    n = (1 << 30) if device == "cuda" else (1 << 20)
    src = torch.empty(n, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * n / ms_of(lambda: dst.copy_(src)) / 1e6


def bench(args):
    ms_of = timer(args.device, args.reps)
    copy = copy_gbs(args.device, ms_of)
    rows = []
    for shape in args.shapes:
        m, k = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device=args.device).to(args.dtype)
        amax = tensor_amax(x)
        for kind in CASTS:
            impls = {"tpflash": fused(kind), "eager quantize": eager(kind)}
            if args.compile:
                impls["torch.compile(quantize)"] = torch.compile(eager(kind))
            for name, fn in impls.items():
                ms = ms_of(lambda: fn(x, amax))
                gbs = bytes_moved(kind, x) / ms / 1e6
                rows.append((f"{m}x{k}", kind, name, ms, gbs, 100 * gbs / copy))
            print(f"<!-- {shape} {kind} done -->", flush=True)
    return copy, rows


def _num(v):
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"  # CPU smoke runs are far under 1 GB/s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["8192x2048", "8192x5632", "16384x4096"], help="MxK")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave out torch.compile")
    parser.add_argument("--reps", type=int, default=5, help="CPU only: timed runs per case (median)")
    args = parser.parse_args()
    args.dtype = torch.bfloat16
    backend = "triton" if args.device == "cuda" or interpreting() else "auto"  # CPU without the interpreter: quantize
    with use_backend(backend):
        copy, rows = bench(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {device}, torch {torch.__version__}, bf16 -> e4m3, tpflash backend {backend}, "
          f"copy bandwidth {copy:.0f} GB/s (1 GiB copy_, bytes read + written)")
    print("| shape | cast | impl | ms | GB/s | of copy |\n|---|---|---|---:|---:|---:|")
    for shape, kind, name, ms, gbs, pct in rows:
        print(f"| {shape} | {kind} | {name} | {ms:.3f} | {_num(gbs)} | {_num(pct)}% |")


if __name__ == "__main__":
    main()
