#!/usr/bin/env bash
# The README's first command: on a CPU machine, train a small byte-level GPT with tensor parallelism
# (tp=2 over 2 CPU ranks, torchrun + gloo) on the Python standard library's own sources, saving
# sharded checkpoints; then resume the tp=2 checkpoint in ONE process (tp=1), continue the loss
# curve, and generate a sample. About 3-4 minutes on 2 cores. Output: runs/demo/ (metrics.jsonl,
# ckpt/). Set TPFLASH_DEMO_DIR to put it elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
TPFLASH_PLAIN=1 source scripts/env.sh   # the demo needs the plain install only
export OMP_NUM_THREADS=1   # one thread per rank: 2 ranks on 2 cores
# CPU on every machine: on a GPU machine torchrun's two ranks would otherwise ask for two GPUs, and the
# output below (fp32 on CPU) is what docs/training.md shows. GPU runs: README, "Training on GPUs".
export CUDA_VISIBLE_DEVICES=""
RUN="${TPFLASH_DEMO_DIR:-runs/demo}"
rm -rf "$RUN"              # the demo starts fresh (a real run would resume from $RUN/ckpt)
start=$(date +%s)
common=(--config demo --checkpoint.dir="$RUN/ckpt" --log.dir="$RUN")

echo "== 1/2: tp=2 over 2 CPU ranks: steps 1-300, checkpoints every 100 steps =="
python -m torch.distributed.run --standalone --nproc_per_node=2 -m tpflash.train "${common[@]}" \
  --tp=2 --train.steps=300 --log.sample_tokens=0

echo
echo "== 2/2: resume the tp=2 checkpoint in one process (tp=1): steps 301-400, then a sample =="
OMP_NUM_THREADS=2 python -m tpflash.train "${common[@]}" --tp=1 --train.steps=400

echo
echo "demo finished in $(( $(date +%s) - start ))s; metrics: $RUN/metrics.jsonl, checkpoints: $RUN/ckpt"
