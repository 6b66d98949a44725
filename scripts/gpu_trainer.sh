#!/usr/bin/env bash
# One short trainer run on one GPU, for A/Bs between trees: gpt-1.3b at tp=1, 4 x 2048 tokens per
# step, byte-level text with the 50304 vocabulary, no checkpoint; prints the layout and [train] lines,
# each prefixed with TAG, and writes metrics.jsonl under $OUT/run_TAG.
#   bash scripts/gpu_trainer.sh TREE TAG [--more=overrides ...]     (STEPS, default 40; LOG, default 10)
set -uo pipefail
TREE=$1 TAG=$2; shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-bench_out}"); mkdir -p "$OUT"
cd "$TREE" && PYTHONPATH=$PWD timeout 150 python3 -m tpflash.train --config configs/gpt-1.3b.yaml --tp=1 \
  --data.path=@stdlib --data.include='*.py' --data.format=text --data.tokenizer=byte --data.max_bytes=20000000 \
  --model.vocab_size=50304 --train.batch_size=4 --train.micro_batch_size=4 --train.warmup_steps=5 \
  --train.steps="${STEPS:-40}" --train.eval_interval=1000 --train.eval_batches=1 --checkpoint.dir= \
  --log.interval="${LOG:-10}" --log.progress=lines --log.dir="$OUT/run_$TAG" "$@" 2>&1 \
  | grep -E "^layout|^\[train\]|Error|error" | sed "s/^/$TAG /"
