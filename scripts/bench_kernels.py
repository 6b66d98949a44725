"""Benchmark tpflash's kernels against PyTorch peers on one GPU, side by side, and print one table.

    PYTHONPATH=$PWD python3 scripts/bench_kernels.py [--quick]

Attention: TFLOP/s of forward and forward+backward ("tpflash triton": the Triton kernel; "tpflash
auto": what the dispatcher runs on [batch, seq, heads, dim] inputs) (bwd = 2.5x fwd FLOPs; causal halves them) vs
torch SDPA's flash, cuDNN and efficient backends, MHA, 16k tokens per batch. Norms, rotary,
cross-entropy and the bias gradients' column sum: GB/s (bytes that must move at least once / time)
vs eager PyTorch and torch.compile, beside the GPU's measured copy bandwidth. Fused linear-CE: time
and peak extra memory vs the naive logits path. Every number printed comes from this run.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from tpflash.kernels import apply_rotary, column_sum, flash_attention, layer_norm, rms_norm, use_backend
from tpflash.losses import fused_linear_cross_entropy, vocab_parallel_cross_entropy

DEV, BF16 = "cuda", torch.bfloat16


def row(kind, config, impl, a, b="", unit=""):
    fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else str(x)  # noqa: E731
    print(f"| {kind} | {config} | {impl} | {fmt(a)} | {fmt(b)} | {unit} |", flush=True)


def timed(fn, rep=50):
    try:
        return do_bench(fn, warmup=10, rep=rep)  # ms
    except Exception as e:  # a peer that does not support a configuration
        print(f"<!-- {type(e).__name__}: {str(e).splitlines()[0][:120]} -->", flush=True)
        return float("nan")


def fwd_bwd(fn, inputs, grad):
    def run():
        for t in inputs:
            t.grad = None
        fn().backward(grad)
    return run


def bench_attention(seqs, head_dims, group=1):
    """`group` q heads per kv head (GQA when > 1: the SDPA peers get enable_gqa=True)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    peers = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
             "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}
    gqa = {"enable_gqa": True} if group > 1 else {}
    for hd in head_dims:
        heads = 2048 // hd
        kv_heads = heads // group
        for causal in (False, True):
            for seq in seqs:
                batch = max(1, 16384 // seq)
                flops = 4 * batch * heads * seq * seq * hd / (2 if causal else 1)
                q, k, v = (torch.randn(batch, seq, h, hd, device=DEV, dtype=BF16, requires_grad=True)
                           for h in (heads, kv_heads, kv_heads))
                qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
                grad = torch.randn_like(q)
                def ours(backend):
                    def run():
                        with use_backend(backend):
                            return flash_attention(q, k, v, causal=causal)
                    return run
                impls = {"tpflash triton": ((q, k, v), ours("triton"), grad),
                         "tpflash auto": ((q, k, v), ours("auto"), grad)}
                for name, backend in peers.items():
                    def sdpa(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)
                    impls[name] = ((qt, kt, vt), sdpa, grad.transpose(1, 2).contiguous())
                for name, (inputs, fn, g) in impls.items():
                    with torch.no_grad():
                        t_f = timed(fn)
                    t_fb = timed(fwd_bwd(fn, inputs, g))
                    row("attention", f"hd{hd} {'causal' if causal else 'full'} seq{seq} b{batch} h{heads}"
                        + (f" kv{kv_heads}" if group > 1 else ""), name,
                        flops / t_f / 1e9, 3.5 * flops / t_fb / 1e9, "TFLOP/s fwd / fwd+bwd")
                q = k = v = qt = kt = vt = grad = impls = None  # free this size's tensors before the next
                torch.cuda.empty_cache()


def bench_copy():
    x = torch.empty(1 << 30, device=DEV, dtype=torch.uint8)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x))
    gbs = 2 * x.numel() / t / 1e6
    row("copy", "1 GiB", "torch copy_", gbs, "", "GB/s")
    return gbs


def _rms_eager(x, w, eps=1e-6):
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _rotate_half_eager(x, cos, sin):  # the Hugging Face Llama formulation, in the input dtype
    c = torch.cat([cos, cos], -1)[:, None, :].to(x.dtype)
    s = torch.cat([sin, sin], -1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


def bench_memory_bound(copy_gbs):
    tokens, hidden = 16384, 4096
    x = torch.randn(tokens, hidden, device=DEV, dtype=BF16, requires_grad=True)
    w = torch.ones(hidden, device=DEV, dtype=BF16, requires_grad=True)
    b = torch.zeros(hidden, device=DEV, dtype=BF16, requires_grad=True)
    cases = {
        "layer_norm": {"tpflash": lambda: layer_norm(x, w, b),
                       "eager": lambda: F.layer_norm(x, (hidden,), w, b),
                       "compile": torch.compile(lambda: F.layer_norm(x, (hidden,), w, b))},
        "rms_norm": {"tpflash": lambda: rms_norm(x, w), "eager": lambda: _rms_eager(x, w),
                     "compile": torch.compile(lambda: _rms_eager(x, w))},
    }
    xr = torch.randn(4, 4096, 32, 128, device=DEV, dtype=BF16, requires_grad=True)
    ang = torch.rand(4096, 64, device=DEV)
    cos, sin = ang.cos(), ang.sin()
    cases["rotary"] = {"tpflash": lambda: apply_rotary(xr, cos, sin),
                       "eager": lambda: _rotate_half_eager(xr, cos, sin),
                       "compile": torch.compile(lambda: _rotate_half_eager(xr, cos, sin))}
    logits = torch.randn(4096, 128256, device=DEV, dtype=BF16, requires_grad=True)
    target = torch.randint(0, 128256, (4096,), device=DEV)
    cases["cross_entropy"] = {"tpflash": lambda: vocab_parallel_cross_entropy(logits, target),
                              "eager": lambda: F.cross_entropy(logits.float(), target),
                              "compile": torch.compile(lambda: F.cross_entropy(logits.float(), target))}
    for kind, impls in cases.items():
        inp = {"rotary": xr, "cross_entropy": logits}.get(kind, x)
        size = inp.numel() * 2
        for name, fn in impls.items():
            with torch.no_grad():
                t_f = timed(fn)
            out = fn()
            g = torch.ones((), device=DEV) if out.dim() == 0 else torch.randn_like(out)
            t_fb = timed(fwd_bwd(fn, [inp, w, b], g))
            fwd_bytes = size * (1 if kind == "cross_entropy" else 2)  # CE reads the logits; others read + write
            bwd_bytes = size * (2 if kind in ("cross_entropy", "rotary") else 3)  # (x,) dy -> dx
            row(kind, f"{tuple(inp.shape)} bf16", name, fwd_bytes / t_f / 1e6, (fwd_bytes + bwd_bytes) / t_fb / 1e6,
                f"GB/s fwd / fwd+bwd (copy {copy_gbs:.0f})")
    # the statistics kernel alone (no loss assembly around it): how much of the CE forward is the kernel
    from tpflash.kernels.cross_entropy import cross_entropy_stats
    with torch.no_grad():
        t_stats = timed(lambda: cross_entropy_stats(logits, target, logits.shape[1]))
    row("cross_entropy", f"{tuple(logits.shape)} bf16", "tpflash stats kernel only", logits.numel() * 2 / t_stats / 1e6,
        float("nan"), f"GB/s fwd (copy {copy_gbs:.0f})")


def bench_column_sum(copy_gbs):
    """The bias gradients' fp32 sum over tokens: GB/s of the bf16 matrix read once. Timed in a CUDA graph,
    as the graphed training step runs it (no launch overhead), over 4 matrices in turn (more than the L2
    holds, so each is read from HBM)."""
    compiled = torch.compile(lambda x: x.sum(0, dtype=torch.float32))
    for cols in (2048, 6144, 8192):
        xs = [torch.randn(8192, cols, device=DEV, dtype=BF16) for _ in range(4)]
        impls = {"tpflash": column_sum, "eager": lambda x: x.sum(0, dtype=torch.float32), "compile": compiled}
        for name, fn in impls.items():
            fn(xs[0])  # compile outside the graph
            ms = do_bench_cudagraph(lambda: [fn(x) for x in xs]) / len(xs)
            row("column_sum", f"{tuple(xs[0].shape)} bf16", name, xs[0].numel() * 2 / ms / 1e6, "",
                f"GB/s, CUDA graph (copy {copy_gbs:.0f})")


def bench_concat(copy_gbs):
    """The stacked q/k/v gradient: concat_with_column_sum (one pass: cat and the biases' column sums)
    against torch.cat + column_sum (before), on [s, b, c] views of [b, s, c] memory as the attention
    returns them. Microseconds per call in a CUDA graph over 4 inputs (read from HBM)."""
    from tpflash.kernels import concat_with_column_sum
    for width in (2048, 1280):  # gpt-1.3b at tp=1, gpt-2.7b at tp=2
        inputs = [[torch.randn(4, 2048, width, device=DEV, dtype=BF16).transpose(0, 1) for _ in range(3)]
                  for _ in range(4)]
        def before(ps):
            y = torch.cat(ps, -1).view(-1, 3 * width)
            return y, column_sum(y)
        impls = {"tpflash": concat_with_column_sum, "torch.cat + column_sum": before}
        for name, fn in impls.items():
            ms = do_bench_cudagraph(lambda: [fn(ps) for ps in inputs]) / len(inputs)
            row("concat_with_column_sum", f"3 x [2048, 4, {width}] bf16", name, 1000 * ms, "",
                f"us, CUDA graph (copy {copy_gbs:.0f} GB/s)")


def bench_bias_activation(copy_gbs):
    """The MLP's activation with its bias: tpflash's bias_activation (forward: GELU(y + b); backward: dy
    and the bias gradient's column sum in one pass) against what the MLP ran before it (the bias in
    the GEMM's epilogue, F.gelu, then gelu_backward and column_sum) and torch.compile of the same
    math. Microseconds per [8192, cols] bf16 matrix, in a CUDA graph over 4 matrices (read from HBM)."""
    from tpflash.kernels.bias_activation_kernel import triton_bias_activation
    gelu_bwd = torch.ops.aten.gelu_backward
    compiled_fwd = torch.compile(lambda y, b: F.gelu(y + b, approximate="tanh"))
    compiled_bwd = torch.compile(lambda dh, y, b: (lambda dy: (dy, dy.float().sum(0)))(
        gelu_bwd(dh, y + b, approximate="tanh")))
    for cols in (8192, 5120):
        ys = [torch.randn(8192, cols, device=DEV, dtype=BF16) for _ in range(4)]
        dhs = [torch.randn_like(y) for y in ys]
        b = torch.randn(cols, device=DEV)
        impls = {"tpflash": (lambda y: triton_bias_activation(y, b, "gelu"),
                             lambda dh, y: triton_bias_activation(y, b, "gelu", dh=dh)),
                 "F.gelu; gelu_backward + column_sum": (lambda y: F.gelu(y, approximate="tanh"),
                                                        lambda dh, y: column_sum(gelu_bwd(dh, y, approximate="tanh"))),
                 "compile": (lambda y: compiled_fwd(y, b), lambda dh, y: compiled_bwd(dh, y, b))}
        for name, (fwd, bwd) in impls.items():
            fwd(ys[0]), bwd(dhs[0], ys[0])  # compile outside the graph
            t_f = do_bench_cudagraph(lambda: [fwd(y) for y in ys]) / len(ys)
            t_b = do_bench_cudagraph(lambda: [bwd(dh, y) for dh, y in zip(dhs, ys)]) / len(ys)
            row("bias+GELU", f"(8192, {cols}) bf16", name, 1e3 * t_f, 1e3 * t_b,
                f"us fwd / bwd, CUDA graph (copy {copy_gbs:.0f} GB/s)")


def bench_swiglu(copy_gbs):
    """The gated MLP's activation on the halves of one [8192, 2n] GEMM output: tpflash's swiglu (one pass
    each way; the backward writes [d_up | d_gate] as one buffer, the stacked GEMM's gradient) against
    what the MLP ran before it (F.silu(gate) * up; autograd's silu/mul backward, then torch.cat of
    the two gradients) and torch.compile of that math. Microseconds per matrix, in a CUDA graph over 4."""
    from tpflash.kernels.swiglu_kernel import triton_swiglu
    silu_bwd = torch.ops.aten.silu_backward

    def eager_bwd(dh, u, g, s):  # s = silu(g), saved by autograd in the forward
        return torch.cat([dh * s, silu_bwd(dh * u, g)], dim=-1)
    compiled_fwd = torch.compile(lambda u, g: F.silu(g) * u)
    compiled_bwd = torch.compile(lambda dh, u, g: torch.cat([dh * F.silu(g), silu_bwd(dh * u, g)], dim=-1))
    for n in (5632, 2816):  # llama-1b's ffn at tp=1 and tp=2
        ys = [torch.randn(8192, 2 * n, device=DEV, dtype=BF16) for _ in range(4)]
        halves = [(y[:, :n], y[:, n:]) for y in ys]
        dhs = [torch.randn(8192, n, device=DEV, dtype=BF16) for _ in ys]
        saved = [F.silu(g) for _, g in halves]
        bufs = [torch.empty(8192, 2 * n, device=DEV, dtype=BF16) for _ in ys]
        impls = {"tpflash": (lambda u, g: triton_swiglu(u, g),
                             lambda dh, u, g, s, buf: triton_swiglu(u, g, dh, out=(buf[:, :n], buf[:, n:]))),
                 "F.silu * up; autograd + cat": (lambda u, g: F.silu(g) * u,
                                                 lambda dh, u, g, s, buf: eager_bwd(dh, u, g, s)),
                 "compile": (compiled_fwd, lambda dh, u, g, s, buf: compiled_bwd(dh, u, g))}
        for name, (fwd, bwd) in impls.items():
            fwd(*halves[0]), bwd(dhs[0], *halves[0], saved[0], bufs[0])  # compile outside the graph
            t_f = do_bench_cudagraph(lambda: [fwd(u, g) for u, g in halves]) / len(ys)
            t_b = do_bench_cudagraph(lambda: [bwd(dh, u, g, s, buf) for dh, (u, g), s, buf
                                              in zip(dhs, halves, saved, bufs)]) / len(ys)
            row("SwiGLU", f"(8192, 2x{n}) bf16", name, 1e3 * t_f, 1e3 * t_b,
                f"us fwd / bwd, CUDA graph (copy {copy_gbs:.0f} GB/s)")


def bench_fused_linear_ce(tokens=16384, hidden=4096, vocab=128256):
    h = torch.randn(tokens, hidden, device=DEV, dtype=BF16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEV) / 64).to(BF16).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device=DEV)
    impls = {"naive": lambda: F.cross_entropy((h @ w.t()).float(), t),
             "tpflash fused": lambda: fused_linear_cross_entropy(h, w, t)}
    for name, fn in impls.items():
        step = fwd_bwd(fn, [h, w], torch.ones((), device=DEV))
        step()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        row("linear+CE", f"tokens{tokens} hidden{hidden} vocab{vocab} bf16", name, timed(step, rep=300), peak,
            "ms fwd+bwd / peak extra GiB (incl. grads)")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="attention at seq 4096 and hd 128 only")
    p.add_argument("--head-dims", default="128,64", help="attention head dims, comma list")
    p.add_argument("--seqs", default="1024,4096,16384", help="attention sequence lengths, comma list")
    p.add_argument("--gqa", type=int, default=1, metavar="G", help="q heads per kv head (Llama-1b: 8)")
    p.add_argument("--attention-only", action="store_true", help="skip the memory-bound and linear+CE parts")
    p.add_argument("--no-attention", action="store_true", help="skip the attention part")
    p.add_argument("--only", default="", choices=("", "bias_activation", "column_sum", "concat", "memory_bound",
                                                  "swiglu"),
                   help="run only this memory-bound part")
    args = p.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    head_dims = [int(h) for h in args.head_dims.split(",")]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    print("| kernel | config | impl | value A | value B | unit |\n|---|---|---|---|---|---|", flush=True)
    if not args.no_attention and not args.only:
        bench_attention([4096] if args.quick else seqs, [128] if args.quick else head_dims, args.gqa)
    if args.attention_only:
        return 0
    copy_gbs = bench_copy()
    if args.only:
        globals()[f"bench_{args.only}"](copy_gbs)
        return 0
    bench_memory_bound(copy_gbs)
    bench_column_sum(copy_gbs)
    bench_concat(copy_gbs)
    bench_bias_activation(copy_gbs)
    bench_swiglu(copy_gbs)
    bench_fused_linear_ce()
    return 0


if __name__ == "__main__":
    sys.exit(main())
