"""What the memory layout of q/k/v costs cuDNN attention, forward + backward, on one GPU.

    PYTHONPATH=$PWD python3 scripts/bench_attention_layout.py [--models gpt-1.3b,gpt-2.7b] [--tp 1] [--rounds 3]

tpflash's blocks keep activations as [seq, batch, hidden] (sequence parallelism splits dim 0), so
q/k/v reach the attention kernel as views of one [seq, batch, 3 * hidden] GEMM output: neighbouring
positions of one sequence lie batch * 3 * hidden elements apart. For causal attention over 4 x 2048
tokens (bf16) this times torch SDPA's cuDNN backend with q/k/v as:
  "seq-major views"   views of one [seq, batch, 3h] tensor (tpflash's blocks);
  "batch-major views" views of one [batch, seq, 3h] tensor;
  "separate"          three contiguous [batch, seq, h] tensors (a plain PyTorch GPT);
each forward + backward to the gradient of the tensor(s) the views come from, the output's gradient
arriving in the same major order. Variants alternate over --rounds rounds; cells are medians (us).
The last column is the time of cuDNN's own kernels alone (torch.profiler): the views' total also
holds the copy that assembles the stacked gradient, which tpflash's blocks do in another kernel.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

BF16 = torch.bfloat16
MODELS = {"gpt-1.3b": (2048, 16), "gpt-2.7b": (2560, 32)}  # hidden, heads
BATCH, SEQ = 4, 2048


def attention(q, k, v):
    """q/k/v [b, s, heads, hd] (any strides) -> [b, s, heads, hd], causal, cuDNN."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def variants(hidden: int, heads: int):
    """{name: fn running forward + backward} for one layout each."""
    hd = hidden // heads

    def seq_major():
        qkv = torch.randn(SEQ, BATCH, 3 * hidden, device="cuda", dtype=BF16, requires_grad=True)
        grad = torch.randn(SEQ, BATCH, hidden, device="cuda", dtype=BF16)

        def run():
            q, k, v = (t.view(SEQ, BATCH, heads, hd).transpose(0, 1) for t in qkv.split(hidden, -1))
            out = attention(q, k, v).transpose(0, 1).reshape(SEQ, BATCH, hidden)
            torch.autograd.grad(out, qkv, grad)
        return run

    def batch_major():
        qkv = torch.randn(BATCH, SEQ, 3 * hidden, device="cuda", dtype=BF16, requires_grad=True)
        grad = torch.randn(BATCH, SEQ, hidden, device="cuda", dtype=BF16)

        def run():
            q, k, v = (t.view(BATCH, SEQ, heads, hd) for t in qkv.split(hidden, -1))
            out = attention(q, k, v).reshape(BATCH, SEQ, hidden)
            torch.autograd.grad(out, qkv, grad)
        return run

    def separate():
        qkv = [torch.randn(BATCH, SEQ, hidden, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3)]
        grad = torch.randn(BATCH, SEQ, hidden, device="cuda", dtype=BF16)

        def run():
            q, k, v = (t.view(BATCH, SEQ, heads, hd) for t in qkv)
            out = attention(q, k, v).reshape(BATCH, SEQ, hidden)
            torch.autograd.grad(out, qkv, grad)
        return run
    return {"seq-major views": seq_major(), "batch-major views": batch_major(), "separate": separate()}


def cudnn_us(fn, iters: int = 20) -> float:
    """us per call spent in cuDNN's kernels (names with "cudnn"), from a profile of `iters` calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if "cudnn" in e.key)
    return total / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt-1.3b,gpt-2.7b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, tp={args.tp}, batch {BATCH} x seq {SEQ}")
    print(f"\n| model | tp | layout | fwd+bwd us (median of {args.rounds}) | all rounds | cuDNN kernels us |"
          "\n|---|---|---|---:|---|---:|")
    for model in args.models.split(","):
        hidden, heads = MODELS[model]
        runs = variants(hidden // args.tp, heads // args.tp)
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name].append(1000 * do_bench(fn, warmup=10, rep=80))
        for name, ts in times.items():
            cells = " / ".join(f"{t:.1f}" for t in ts)
            print(f"| {model} | {args.tp} | {name} | {statistics.median(ts):.1f} | {cells} | "
                  f"{cudnn_us(runs[name]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
