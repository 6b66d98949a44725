"""Packed (varlen) causal attention, forward + backward, against cuDNN on unpacked batches (one GPU).

For each shape the same tokens are laid out two ways: "equal" (every document as long as the
unpacked sequence: the same work as the unpacked batch) and "mixed" (random document lengths,
as packed fine-tuning data gives). Candidates: cuDNN through SDPA on the unpacked batch (the
reference speed), tpflash's Triton varlen kernel, PyTorch's flash-attention varlen kernels
(tpflash.kernels.varlen_flash), and FlexAttention with a document mask (compiled).

    python benchmarks/varlen_attention.py            # prints one table; --json FILE also writes rows
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from tpflash.kernels.flash_attn import triton_flash_attention
from tpflash.kernels.reference import attention_reference


def doc_lengths(kind: str, rows: int, seq: int, gen: torch.Generator):
    """Document lengths per row, each row summing to seq."""
    out = []
    for _ in range(rows):
        if kind == "equal":
            out.append([seq])
            continue
        left, row = seq, []
        while left:
            n = min(left, int(torch.randint(32, seq // 2 + 1, (1,), generator=gen)))
            row.append(n)
            left -= n
        out.append(row)
    return out


def time_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def fwd_bwd(attn, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.backward(attn(q, k, v), grad)


def flex_runner(lengths, heads_q, heads_kv, scale, mask_every_call=False):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    doc = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(x for r in lengths for x in r)])
    doc = doc.cuda()

    def causal_doc(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    mask = create_block_mask(causal_doc, None, None, len(doc), len(doc), device="cuda")
    compiled = torch.compile(flex_attention)
    gqa = heads_q != heads_kv

    def attn(q, k, v):  # [total, h, d] -> [1, h, total, d]
        nonlocal mask
        if mask_every_call:  # a training step builds its batch's mask once (here: once per fwd+bwd)
            mask = create_block_mask(causal_doc, None, None, len(doc), len(doc), device="cuda")
        o = compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
                     scale=scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)
    return attn


class VarlenFlashAttention(torch.autograd.Function):
    """out = softmax(q k^T * scale [causal within each sequence]) v for packed sequences.

    q [total, heads_q, d], k/v [total, heads_kv, d] (contiguous), cu_seqlens int32 [n + 1] (the
    same for q and k), max_seqlen the longest sequence. Returns out [total, heads_q, d].
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, causal, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_seqlen, ctx.causal, ctx.scale = max_seqlen, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, ctx.causal,
            seed, offset, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


def check_close(a, b, what):
    err = (a.float() - b.float()).abs().max().item()
    if err > 2e-2:
        raise AssertionError(f"{what}: max abs error {err:.3g} against the reference")
    return err


def run_shape(rows, seq, heads_q, heads_kv, hd, kind, gen):
    dtype, dev = torch.bfloat16, "cuda"
    lengths = doc_lengths(kind, rows, seq, gen)
    flat = [n for r in lengths for n in r]
    cu = torch.tensor([0] + list(torch.tensor(flat).cumsum(0)), dtype=torch.int32, device=dev)
    total, max_len, scale = rows * seq, max(flat), 1 / math.sqrt(hd)
    q = torch.randn(total, heads_q, hd, device=dev, dtype=dtype)
    k = torch.randn(total, heads_kv, hd, device=dev, dtype=dtype)
    v = torch.randn(total, heads_kv, hd, device=dev, dtype=dtype)
    grad = torch.randn_like(q)
    candidates = {
        "triton-varlen": lambda q, k, v: triton_flash_attention(q, k, v, True, scale, cu, max_len)[0],
        "fa2-varlen": lambda q, k, v: VarlenFlashAttention.apply(q, k, v, cu, max_len, True, scale),
        "flex-docmask": flex_runner(lengths, heads_q, heads_kv, scale),
        "flex+mask-build": flex_runner(lengths, heads_q, heads_kv, scale, mask_every_call=True),
    }
    # correctness on the first 2 documents' worth of rows against the fp32 reference
    small = int(cu[min(2, len(flat))])
    ref = attention_reference(q[:small], k[:small], v[:small], True, scale, cu[:min(2, len(flat)) + 1], None)
    rows_out = []
    for name, attn in candidates.items():
        stage = "forward"
        try:
            err = check_close(attn(q, k, v)[:small], ref, name)
            stage = "backward"
            ms = time_ms(fwd_bwd(attn, q, k, v, grad))
        except Exception as exc:  # noqa: BLE001 - a candidate this torch lacks is reported, not fatal
            rows_out.append(dict(impl=name, error=f"{stage}: {type(exc).__name__}: {str(exc)[:100]}"))
            continue
        rows_out.append(dict(impl=name, ms=ms, max_err=err))
    # the unpacked reference: cuDNN on [rows, seq] (the same tokens, each row one sequence)
    qb, kb, vb = (t.view(rows, seq, -1, hd).transpose(1, 2) for t in (q, k, v))
    gb = grad.view(rows, seq, heads_q, hd).transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=heads_q != heads_kv)
    rows_out.append(dict(impl="cudnn-unpacked", ms=time_ms(fwd_bwd(cudnn, qb, kb, vb, gb))))
    base = rows_out[-1]["ms"]
    for r in rows_out:
        r.update(rows=rows, seq=seq, heads=f"{heads_q}/{heads_kv}", hd=hd, docs=kind, n_docs=len(flat))
        if "ms" in r:
            r["tokens_per_s"] = total / r["ms"] * 1e3
            r["vs_cudnn_unpacked"] = base / r["ms"]
    return rows_out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    results = []
    for rows, seq, hq, hkv, hd in [(8, 2048, 32, 4, 64), (4, 4096, 32, 8, 128), (8, 2048, 16, 16, 128)]:
        for kind in ("equal", "mixed"):
            results += run_shape(rows, seq, hq, hkv, hd, kind, gen)
    print(f"{'shape':>26} {'docs':>6} {'impl':>15} {'ms':>8} {'Mtok/s':>8} {'x cuDNN':>8}")
    for r in results:
        shape = f"{r['rows']}x{r['seq']} h{r['heads']} d{r['hd']}"
        if "error" in r:
            print(f"{shape:>26} {r['docs']:>6} {r['impl']:>15}  {r['error']}")
        else:
            print(f"{shape:>26} {r['docs']:>6} {r['impl']:>15} {r['ms']:8.3f} {r['tokens_per_s'] / 1e6:8.2f} "
                  f"{r['vs_cudnn_unpacked']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
