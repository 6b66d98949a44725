"""Benchmark the fused dense extension against eager PyTorch and torch.compile, in one run.

For the MLP shapes of gpt-1.3b (hidden 2048, ffn 8192) and gpt-2.7b (hidden 2560, ffn 10240) at
tp in {1, 2, 4} (each rank's ffn/tp slice), 8192 tokens, bfloat16:
  mlp:    fused_dense_gelu_dense(x, w1, b1, w2, b2)  vs  F.linear -> gelu(tanh) -> F.linear
  linear: fused_dense(x, w1, b1) (the up projection)  vs  F.linear
each as the training forward (inputs requiring grad) and forward+backward, timed with CUDA events
(median of --iters after --warmup). torch.compile of the eager function compiles once per shape;
it stops being tried once --compile-budget seconds are spent. Prints a markdown table and writes
--json. Usage: TPFLASH_JIT_CUDA=1 python benchmarks/fused_dense.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpflash.kernels import fused_dense, fused_dense_gelu_dense  # noqa: E402
from tpflash.kernels.fused_dense import dense_gelu_dense_reference, extension_status, load_extension  # noqa: E402

MODELS = {"gpt-1.3b": (2048, 8192), "gpt-2.7b": (2560, 10240)}


def eager_linear(x, w1, b1, w2, b2):
    return F.linear(x, w1, b1)


def eager_mlp(x, w1, b1, w2, b2):
    return dense_gelu_dense_reference(x, w1, b1, w2, b2)


def fused_linear(x, w1, b1, w2, b2):
    return fused_dense(x, w1, b1)


def fused_mlp(x, w1, b1, w2, b2):
    return fused_dense_gelu_dense(x, w1, b1, w2, b2)


def fused_mlp_h1(x, w1, b1, w2, b2):  # cuBLASLt's second-ranked algorithm for the two GELU GEMMs
    return fused_dense_gelu_dense(x, w1, b1, w2, b2, heuristic=1)


def time_ms(step, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(fn, inputs, d_out, warmup: int, iters: int):
    """(forward ms, forward+backward ms) of fn on inputs that require grad."""
    def forward():
        fn(*inputs)

    def forward_backward():
        out = fn(*inputs)
        torch.autograd.grad(out, inputs, d_out, allow_unused=True)  # linear leaves w2, b2 unused

    return time_ms(forward, warmup, iters), time_ms(forward_backward, warmup, iters)


def make_inputs(tokens: int, hidden: int, ffn_local: int, dtype):
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w1 = torch.randn(ffn_local, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    b1 = torch.randn(ffn_local, device="cuda", dtype=dtype) * 0.1
    w2 = torch.randn(hidden, ffn_local, device="cuda", dtype=dtype) / ffn_local ** 0.5
    b2 = torch.randn(hidden, device="cuda", dtype=dtype) * 0.1
    return [t.requires_grad_() for t in (x, w1, b1, w2, b2)]


def gemm_flops(op: str, tokens: int, hidden: int, ffn_local: int) -> float:
    """Forward matmul flops (backward is twice that)."""
    return 2.0 * tokens * hidden * ffn_local * (2 if op == "mlp" else 1)


def run(args) -> list:
    dtype = getattr(torch, args.dtype)
    rows, compile_spent = [], 0.0
    if hasattr(torch, "_dynamo"):  # one compiled graph per shape: allow them all
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
    for op in args.ops:
        eager, fused = (eager_mlp, fused_mlp) if op == "mlp" else (eager_linear, fused_linear)
        for model, (hidden, ffn) in MODELS.items():
            for tp in args.tp:
                ffn_local = ffn // tp
                inputs = make_inputs(args.tokens, hidden, ffn_local, dtype)
                out_dim = hidden if op == "mlp" else ffn_local
                d_out = torch.randn(args.tokens, out_dim, device="cuda", dtype=dtype)
                row = dict(op=op, model=model, tp=tp, tokens=args.tokens, hidden=hidden, ffn_local=ffn_local,
                           flops_fwd=gemm_flops(op, args.tokens, hidden, ffn_local))
                impls = [("eager", eager)]
                if load_extension() is not None:
                    impls += [("fused", fused)] + ([("fusedh1", fused_mlp_h1)] if op == "mlp" else [])
                if load_extension() is not None:  # which path fused_* took: the extension or the fallback
                    row["fused_node"] = type(fused(*inputs).grad_fn).__name__
                for name, fn in impls:
                    row[f"{name}_fwd_ms"], row[f"{name}_fwd_bwd_ms"] = measure(fn, inputs, d_out, args.warmup,
                                                                               args.iters)
                if op in args.compile_ops and compile_spent < args.compile_budget:
                    started = time.perf_counter()
                    try:
                        compiled = torch.compile(eager, dynamic=False)
                        row["compile_fwd_ms"], row["compile_fwd_bwd_ms"] = measure(compiled, inputs, d_out,
                                                                                   args.warmup, args.iters)
                    except Exception as exc:  # report and go on: the other columns still stand
                        row["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    compile_spent += time.perf_counter() - started
                rows.append(row)
                print(json.dumps(row), flush=True)
                del inputs, d_out
                torch.cuda.empty_cache()
    return rows


def markdown(rows) -> str:
    def cell(row, key):
        return f"{row[key]:.3f}" if key in row else "-"

    def tflops(row, key, passes):
        return f"{passes * row['flops_fwd'] / row[key] / 1e9:.0f}" if key in row else "-"

    lines = ["| op | model | tp | hidden x ffn/tp | pass | eager ms | compile ms | fused ms | fused h=1 ms | "
             "fused TFLOP/s | fused vs eager | fused vs compile |", "|" + "---|" * 12]
    for row in rows:
        for label, suffix, passes in (("fwd", "fwd_ms", 1), ("fwd+bwd", "fwd_bwd_ms", 3)):
            eager, comp, fused = (row.get(f"{name}_{suffix}") for name in ("eager", "compile", "fused"))
            vs_eager = f"{eager / fused:.2f}x" if eager and fused else "-"
            vs_comp = f"{comp / fused:.2f}x" if comp and fused else "-"
            lines.append(f"| {row['op']} | {row['model']} | {row['tp']} | {row['hidden']}x{row['ffn_local']} | "
                         f"{label} | {cell(row, 'eager_' + suffix)} | {cell(row, 'compile_' + suffix)} | "
                         f"{cell(row, 'fused_' + suffix)} | {cell(row, 'fusedh1_' + suffix)} | "
                         f"{tflops(row, 'fused_' + suffix, passes)} | "
                         f"{vs_eager} | {vs_comp} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", nargs="+", default=["mlp", "linear"], choices=["mlp", "linear"])
    parser.add_argument("--compile-ops", nargs="*", default=["mlp", "linear"], choices=["mlp", "linear"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--compile-budget", type=float, default=120.0, help="seconds of torch.compile cases")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--md", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused_dense.py needs a CUDA device")
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cuda {torch.version.cuda}")
    print(f"extension: {extension_status()}", flush=True)
    rows = run(args)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "extension": extension_status(), "rows": rows}, indent=1))
    if args.md:
        args.md.write_text(table + "\n")


if __name__ == "__main__":
    main()
