"""The peer of the trainer's checkpoint: PyTorch DCP's own save of the same model and AdamW state on
the same FSDP2 layout, as torchtitan's checkpoint manager makes it (`get_state_dict`, then `dcp.save`
or `dcp.async_save` with its defaults), timed the way the trainer times its own.

    torchrun --nproc_per_node=4 benchmarks/checkpoint_dcp_peer.py --preset llama-3-8b --dir /data/x --out OUT/dcp

Writes `checkpoint` records (save_s; staged_s and write_s for the async save; GB, GB_per_s) to
OUT/metrics.jsonl, which benchmarks/checkpoint_table.py lists beside the trainer's. `--tiny` (a small
preset on CPU ranks, gloo) is the smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tpflash  # noqa: E402
from tpflash.models import GPT, GPTConfig  # noqa: E402
from tpflash.train.io_times import rate_record  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--dir", required=True, help="where the checkpoints go (removed after each)")
    parser.add_argument("--out", required=True, help="OUT/metrics.jsonl receives the records")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the preset's family, on CPU")
    args = parser.parse_args()
    ps = tpflash.parallel.init(tp=1)
    async_group = dist.new_group(backend="gloo")  # async_save's collectives run on a CPU group (torchtitan's too)
    overrides = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, vocab_size=256) if args.tiny else {}
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset, **overrides), process_group=None, device=ps.device)
    tpflash.parallel.apply_fsdp(model, ps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ps.device.type == "cuda")
    for p in model.parameters():  # one step on zero gradients: AdamW's moments exist, as in training
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    records = []

    def timed(name, save):
        path = os.path.join(args.dir, name)
        dist.barrier()
        start = time.perf_counter()
        out = save(path)
        return path, time.perf_counter() - start, out

    path, seconds, _ = timed("sync", lambda p: dcp.save(state, checkpoint_id=p))
    dist.barrier()
    records.append({"kind": "checkpoint", "step": 1, "time": time.time(), **rate_record("save_s", seconds, path)})
    if ps.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    path, staged, future = timed("async", lambda p: dcp.async_save(state, checkpoint_id=p, process_group=async_group))
    start = time.perf_counter() - staged
    records.append({"kind": "checkpoint", "step": 2, "time": time.time(), "staged_s": round(staged, 3)})
    future.result()
    dist.barrier()
    records.append({"kind": "checkpoint", "step": 2, "time": time.time(),
                    **rate_record("write_s", time.perf_counter() - start, path)})
    if ps.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "metrics.jsonl"), "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
                print("[dcp peer]", " ".join(f"{k}={v}" for k, v in r.items() if k not in ("kind", "time")), flush=True)
    tpflash.parallel.shutdown()


if __name__ == "__main__":
    main()
