#!/usr/bin/env bash
# Fine-tune a Hugging Face model with tpflash and get a Hugging Face model back, on 2 CPU ranks:
#   1. make a tiny Llama 3.2-style model (tied embeddings, llama3 rope scaling) with transformers'
#      save_pretrained, as a stand-in for a downloaded checkpoint;
#   2. fine-tune it at tp=2 (torchrun + gloo) on examples/data/tiny_sft.jsonl: prompt/completion and
#      chat examples, loss on the answers only, examples packed into rows with attention kept inside
#      each example; the weights stream from the safetensors files, each rank reading its own shard;
#   3. export the result as a Hugging Face directory at the end of training;
#   4. reload it with transformers, compare its logits with tpflash's, and generate a few tokens.
# About a minute on 2 cores. Output: runs/finetune/ (TPFLASH_FINETUNE_DIR to put it elsewhere;
# TPFLASH_FINETUNE_STEPS: training steps, default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""   # 2 CPU ranks on 2 cores (see scripts/demo.sh)
RUN="${TPFLASH_FINETUNE_DIR:-runs/finetune}"
STEPS="${TPFLASH_FINETUNE_STEPS:-60}"
rm -rf "$RUN"
mkdir -p "$RUN"

echo "== 1/4: a tiny Llama 3.2-style model saved with save_pretrained: $RUN/base =="
python - "$RUN/base" <<'EOF'
import sys, torch, transformers
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
model = transformers.LlamaForCausalLM(config)
model.save_pretrained(sys.argv[1], max_shard_size="500KB")  # several files + index, as large models come
print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
EOF

echo
echo "== 2/4 and 3/4: fine-tune at tp=2 on 2 CPU ranks (packed jsonl, loss on answers), export at the end =="
python -m torch.distributed.run --standalone --nproc_per_node=2 -m tpflash.train --tp=2 \
  --model.init_from="$RUN/base" --model.sequence_parallel=true \
  --data.path=examples/data/tiny_sft.jsonl --data.seq_len=256 --data.eval_fraction=0.1 \
  --train.steps="$STEPS" --train.batch_size=8 --train.lr=3e-3 --train.warmup_steps=5 --train.eval_interval=30 \
  --log.dir="$RUN" --log.interval=10 --log.progress=lines \
  --checkpoint.dir="$RUN/ckpt" --checkpoint.export_hf="$RUN/hf"

echo
echo "== 4/4: reload $RUN/hf with transformers; logits against tpflash's; a short generation =="
python - "$RUN/hf" <<'EOF'
import sys, torch, transformers
import tpflash
transformers.logging.set_verbosity_error()
hf_dir = sys.argv[1]
hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
ours = tpflash.models.from_pretrained(hf_dir, dtype=torch.float32).eval()
prompt = "Q: What is 12 + 30?\nA: "
ids = torch.tensor([list(prompt.encode())])
with torch.no_grad():
    gap = (hf(ids).logits - ours(ids)[..., :256]).abs().max().item()
    out = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
print(f"max |logits(transformers) - logits(tpflash)| = {gap:.2e}")
print(f"transformers generates: {prompt!r} -> {bytes(out[0, ids.shape[1]:].tolist()).decode(errors='replace')!r}")
assert gap < 1e-4, "the exported model does not compute what tpflash computed"
EOF
echo
echo "finished: base model $RUN/base, checkpoints $RUN/ckpt, fine-tuned Hugging Face model $RUN/hf"
