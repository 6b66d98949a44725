"""Fine-tuning a 1B-class Llama from a Hugging Face directory on one GPU: streaming load, then packed
against unpacked (padded) jsonl training, in one run.

1. Saves a random Llama of the llama-1b shape (d 2048, 22 layers, 32/4 heads, ffn 5632, vocab 32000)
   with transformers' `save_pretrained` (bf16, sharded files), as a downloaded model would come.
2. Writes synthetic prompt/completion jsonl whose lengths vary as instruction data does.
3. Builds the trainer with `model.init_from` (weights streamed from the safetensors files) and
   records host memory growth (RssAnon) and time for building it, and its GPU memory.
4. Trains `--steps` steps with data.pack=true and with data.pack=false (one example per padded
   row) and reports the tokens that carry loss per second, which is what a fine-tune pays for.

    python benchmarks/finetune_packed.py --workdir /tmp/ft          # on one GPU
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.rss import PeakRss  # noqa: E402


CUDA = torch.cuda.is_available()  # CPU: a tiny dry run of the script itself (--layers 1 --seq 128 --hidden 64)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def gpu_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0


def save_model(hf_dir: str, layers: int, hidden: int) -> int:
    """A random llama-1b-shaped model saved with save_pretrained (bf16); returns its bytes."""
    import transformers
    if os.path.exists(os.path.join(hf_dir, "config.json")):
        return sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
                                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda" if CUDA else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(hf_dir, max_shard_size="1GB")
    del model
    return save_model(hf_dir, layers, hidden)


def write_jsonl(path: str, n: int) -> None:
    """n prompt/completion examples of random words: prompts 16-512 bytes, completions 32-1536."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tensor", "shard", "rank", "token", "layer", "graph", "kernel"]

    def text(lo, hi):
        length, out = rng.randint(lo, hi), ""
        while len(out) < length:
            out += rng.choice(words) + " "
        return out
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(16, 512), "completion": text(32, 1536)}) + "\n")


def train(hf_dir, data, pack, steps, batch, seq):
    """(build seconds, host RssAnon growth while building, per-step rows) of one trainer."""
    from tpflash.parallel import shutdown
    from tpflash.train import Trainer, parse_args
    cfg = parse_args([f"--model.init_from={hf_dir}", f"--data.path={data}", f"--data.pack={pack}",
                      f"--data.seq_len={seq}", "--data.eval_fraction=0", f"--train.batch_size={batch}",
                      f"--train.steps={steps + 3}", "--train.warmup_steps=2", "--train.lr=1e-5", "--train.min_lr=1e-6"])
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with PeakRss() as rss:
        trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    loaded_gib = gpu_gib()
    for _ in range(3):  # warm-up: allocator, autotuning
        trainer.train_step()
    sync()
    counted = padded = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        rows = trainer.sampler.indices(trainer.sampler.consumed, trainer.plan.batch_size)
        counted += trainer.train_data.loss_tokens(rows)
        padded += len(rows) * seq
        out = trainer.train_step()
    sync()
    seconds = time.perf_counter() - t0
    loss = float(out["loss"])
    result = dict(pack=pack, build_s=build_s, load_rss_anon_gib=rss.anon_growth / 2**30,
                  gpu_mem_after_load_gib=loaded_gib, step_ms=seconds / steps * 1e3,
                  loss_tokens_per_s=counted / seconds, row_tokens_per_s=padded / seconds,
                  loss_token_share=counted / padded, peak_gpu_gib=gpu_gib(),
                  last_loss=loss)
    del trainer, out
    shutdown()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/tpflash_finetune")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--examples", type=int, default=3000)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    hf_dir, data = os.path.join(args.workdir, "llama-1b-hf"), os.path.join(args.workdir, "sft.jsonl")
    model_bytes = save_model(hf_dir, args.layers, args.hidden)
    write_jsonl(data, args.examples)
    device = torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"torch {torch.__version__}, {device}; model files {model_bytes / 2**30:.2f} GiB")
    rows = [train(hf_dir, data, pack, args.steps, args.batch, args.seq) for pack in (True, False)]
    for r in rows:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    packed, padded = rows
    print(f"packed: {packed['loss_tokens_per_s']:,.0f} loss tokens/s, unpacked (padded): "
          f"{padded['loss_tokens_per_s']:,.0f}; packed/unpacked {packed['loss_tokens_per_s'] / padded['loss_tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model_bytes=model_bytes, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
