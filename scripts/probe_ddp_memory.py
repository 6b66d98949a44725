"""Memory of replicated training step by step: the model with no dp reduction against the same model under
tpflash.parallel.replicate_over_dp (DDP), one process on one GPU.

    python scripts/probe_ddp_memory.py [--model gpt-1.3b] [--steps 6]

Prints, for each step, the GiB allocated after the forward and the step's peak, as the trainer runs
a step (bf16 autocast, fused AdamW, zero_grad to None, no sync between steps). DDP keeps its
buckets (the gradients' size) between steps, and regroups them by the first backward's order at
the start of the second forward.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpflash  # noqa: E402
from tpflash.models import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import MODELS  # noqa: E402

GIB = 2 ** 30


def steps_memory(model_name: str, use_ddp: bool, steps: int, ps) -> str:
    shape = MODELS[model_name]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=2048, n_layer=shape["layers"], n_head=shape["heads"],
                    n_embd=shape["d"])
    model = GPT(cfg, process_group=ps.tp_group, device=ps.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    forward = tpflash.parallel.replicate_over_dp(model, ps) if use_ddp else model
    idx = torch.randint(0, cfg.vocab_size, (4, 2049), device=ps.device)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    cells = []
    for step in range(steps):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x, y)
        after_forward = torch.cuda.memory_allocated() / GIB
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cells.append(f"{after_forward:.2f} / {torch.cuda.max_memory_allocated() / GIB:.2f}")
    del model, opt, forward, loss
    gc.collect()
    torch.cuda.empty_cache()
    return f"| {'ddp' if use_ddp else 'none'} | " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt-1.3b", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_ddp_memory.py measures CUDA memory: run it on a GPU")
    ps = tpflash.parallel.init(tp=1)
    print(f"{args.model}, GiB allocated after the forward / peak of the step")
    print("| reduction | " + " | ".join(f"step {s + 1}" for s in range(args.steps)) + " |")
    print("|---|" + "---:|" * args.steps)
    for use_ddp in (False, True, True):  # DDP twice: whether its regrouping costs memory varies by run
        print(steps_memory(args.model, use_ddp, args.steps, ps))
    tpflash.parallel.shutdown()


if __name__ == "__main__":
    main()
