"""Host time of one small F.linear call, variant by variant, on one GPU (what tpflash's linear costs).

The GEMMs are tiny (d=256, 64 tokens), so each call measures the host's work to issue it: which
input layouts, bias handling or dtypes make the same product cost more host time.

    python3 scripts/probe_linear_host.py [--calls 2000] [--d 256] [--tokens 64]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_host_overhead import per_call_us  # noqa: E402


def cases(d: int, tokens: int):
    dev, bf = "cuda", torch.bfloat16
    x3 = torch.randn(tokens, 1, d, device=dev, dtype=bf)
    x2 = x3.view(tokens, d)
    w = torch.randn(d, d, device=dev, dtype=bf)
    b = torch.randn(d, device=dev, dtype=bf)
    flat = torch.empty(3 * d * d + 3 * d, device=dev, dtype=bf)
    w_view = flat[d * d:2 * d * d].view(d, d)  # a weight inside a cast_once buffer
    b_view = flat[3 * d * d + d:3 * d * d + 2 * d]
    yield "F.linear 3-D x, bias", lambda: F.linear(x3, w, b)
    yield "F.linear 2-D x, bias", lambda: F.linear(x2, w, b)
    yield "F.linear 3-D x, no bias", lambda: F.linear(x3, w)
    yield "F.linear 3-D x, weight and bias views of one buffer", lambda: F.linear(x3, w_view, b_view)
    yield "torch.addmm(b, x2, w.t())", lambda: torch.addmm(b, x2, w.t())
    yield "torch.mm(x2, w.t())", lambda: torch.mm(x2, w.t())
    yield "x2 @ w.t()", lambda: x2 @ w.t()
    xg = x3.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    yield "F.linear 3-D x, bias, x and w need grad", lambda: F.linear(xg, wg, b)
    with_autocast = torch.randn(tokens, 1, d, device=dev)
    w32, b32 = torch.randn(d, d, device=dev, requires_grad=True), torch.zeros(d, device=dev, requires_grad=True)

    def autocast_linear():
        with torch.autocast("cuda", dtype=bf):
            return F.linear(with_autocast, w32, b32)
    yield "F.linear under autocast, fp32 weights needing grad", autocast_linear
    from tpflash.layers.autocast_linear import linear

    def tpflash_linear():
        with torch.autocast("cuda", dtype=bf):
            return linear(with_autocast, w32, b32)
    yield "tpflash linear under autocast", tpflash_linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| call | host us |\n|---|---:|")
    for name, fn in cases(args.d, args.tokens):
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} |")


if __name__ == "__main__":
    main()
