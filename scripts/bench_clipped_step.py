"""The optimizer end of a training step on one GPU: global-norm clipping then fused AdamW, with the
clipping as a separate pass (clip_grads_, what torch.nn.utils.clip_grad_norm_ also does) against
folded into the fused kernel (tpflash.train.gradients.clipped_step). Every parameter of a preset
model, fp32, with random gradients; CUDA-event times, median of alternating rounds.

    python3 scripts/bench_clipped_step.py [--model gpt-1.3b] [--rounds 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpflash.models import GPT, GPTConfig  # noqa: E402
from tpflash.train.gradients import clip_grads_, clipped_step, global_grad_norm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-1.3b")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    args = p.parse_args()
    model = GPT(GPTConfig.preset(args.model), device="cuda")
    params = [q for q in model.parameters() if q.requires_grad]
    grads = [torch.randn_like(q) for q in params]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)

    def separate():
        norm = global_grad_norm(model, None, None, False)
        clip_grads_(params, norm, args.clip)
        opt.step()

    def folded():
        norm = global_grad_norm(model, None, None, False)
        clipped_step(opt, params, norm, args.clip)

    variants = {"norm + clip_grads_ + fused AdamW": separate, "norm + clipped_step (fused AdamW)": folded}
    times = {name: [] for name in variants}
    for r in range(args.rounds + 2):
        for name, fn in variants.items():
            for q, g in zip(params, grads):
                q.grad = g.clone()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            if r >= 2:  # the first rounds create the optimizer state
                times[name].append(start.elapsed_time(end))
    n = sum(q.numel() for q in params)
    print(f"{args.model}: {n / 1e9:.2f}G fp32 parameters, {torch.cuda.get_device_name()}, "
          f"median of {args.rounds} alternating rounds")
    print("| variant | ms |\n|---|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} |")


if __name__ == "__main__":
    main()
