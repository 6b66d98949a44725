"""Per-rank memory of loading a Hugging Face model: the streaming path against the old one.

    torchrun --nproc_per_node=4 benchmarks/hf_load_memory.py --hidden 1024 --layers 10 --vocab 32000

Rank 0 saves a random bf16 Llama with transformers (sharded by --shard-size) unless --hf-dir is
given. Then, for each layout (FSDP dp=N tp=1, FSDP dp=N/2 tp=2, tp=N), every rank loads it
  - streaming: tpflash.models.pretrained (meta build, FSDP, to_empty, each rank's slices), and
  - old: transformers.AutoModelForCausalLM.from_pretrained on every rank, then from_hf
    (load_full_state_dict of the full state dict), then FSDP,
and rank 0 prints each rank's peak RssAnon growth (private memory), peak RssFile growth (file pages
mapped in) and, for the streaming path, the bytes of the slices it read. CPU, gloo.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.rss import PeakRss  # noqa: E402
import tpflash  # noqa: E402
from tpflash.models import pretrained  # noqa: E402
from tpflash.parallel import apply_fsdp  # noqa: E402

MiB = 2**20


def save_model(args, directory: str) -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=args.ffn or 256 * -(-8 * args.hidden // 3 // 256),
                                      num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(directory, max_shard_size=args.shard_size)


def streaming(hf_dir: str, ps, fsdp: bool, dtype: torch.dtype):
    with PeakRss() as rss:
        files = pretrained.HFFiles(hf_dir)
        model = pretrained.build_on_meta(pretrained.read_hf_config(hf_dir), dtype=dtype)
        if fsdp:
            apply_fsdp(model, ps)
        model.to_empty(device="cpu")
        read = pretrained.load_pretrained_weights(model, hf_dir, files, verbose=False)
    return rss.anon_growth, rss.file_growth, read


def old_path(hf_dir: str, ps, fsdp: bool, dtype: torch.dtype):
    import transformers
    transformers.logging.set_verbosity_error()
    with PeakRss() as rss:
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        model = tpflash.models.from_hf(hf)
        del hf
        if fsdp:
            apply_fsdp(model, ps)
    return rss.anon_growth, rss.file_growth, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ffn", type=int, default=0, help="MLP width (0: Llama's 8/3 * hidden rule)")
    parser.add_argument("--shard-size", default="100MB")
    parser.add_argument("--dtype", default="bfloat16", help="the loaded model's dtype (float32: a trainer's "
                                                                "master weights)")
    parser.add_argument("--hf-dir", default="", help="an existing Hugging Face directory (else a random Llama)")
    args = parser.parse_args()
    ps = tpflash.parallel.init(tp=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    hf_dir = args.hf_dir or os.path.join(tempfile.gettempdir(), f"tpflash-bench-llama-{args.hidden}-{args.layers}")
    if rank == 0 and not os.path.isfile(os.path.join(hf_dir, "config.json")):
        save_model(args, hf_dir)
    dist.barrier()
    nbytes = sum(info.dtype.itemsize * torch.Size(info.shape).numel()
                 for info in pretrained.HFFiles(hf_dir).tensors.values())
    apply_fsdp(pretrained.build_on_meta(tpflash.models.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2,
                                                                 n_embd=16)), ps)  # first FSDP use: imports
    layouts = [(1, True), (2, True), (world, False)]
    if rank == 0:
        print(f"model {nbytes / MiB:.0f} MiB in {hf_dir}, loaded as {args.dtype}; {world} ranks; growth per rank in MiB "
              "(RssAnon = private memory, RssFile = file pages mapped)")
    for tp, fsdp in layouts:
        ps = tpflash.parallel.init(tp=tp)
        for name, fn in (("streaming", streaming), ("old", old_path)):
            result = fn(hf_dir, ps, fsdp, getattr(torch, args.dtype))
            everyone = [None] * world
            dist.all_gather_object(everyone, result)
            if rank == 0:
                layout = f"dp={world // tp} tp={tp}{' FSDP' if fsdp else ''}"
                anon = " ".join(f"{a / MiB:4.0f}" for a, _, _ in everyone)
                file = " ".join(f"{f / MiB:4.0f}" for _, f, _ in everyone)
                read = "" if everyone[0][2] is None else \
                    " read " + " ".join(f"{r / MiB:.0f}" for _, _, r in everyone)
                print(f"{layout:16s} {name:9s} RssAnon {anon} (max {max(a for a, _, _ in everyone) / nbytes:.2f} "
                      f"x model)  RssFile {file}{read}", flush=True)
    tpflash.parallel.shutdown()


if __name__ == "__main__":
    main()
