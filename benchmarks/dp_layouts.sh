#!/usr/bin/env bash
# At dp > 1, which is faster: FSDP (fsdp=on; it turns the CUDA graphs off, so the blocks run eagerly)
# or fsdp=off (the graphs stay on; DDP all-reduces the gradients over dp once per step; what fsdp=auto
# picks where the replicated state fits in half the device)?
# The trainer on 4 GPUs at tp=2 dp=2, gpt-1.3b, 4 x 2048 tokens per rank and step, byte-level text
# with the 50304 vocabulary; each layout for $STEPS steps (default 40), logged every 10:
#   OUT=<dir> bash benchmarks/dp_layouts.sh [extra trainer overrides]
# Prints the layout line and the [train] lines of each run, tagged; metrics under $OUT/dp_<tag>.
# NPROC=1 TP=1 runs it on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tpflash-dp}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
NPROC=${NPROC:-4}
TP=${TP:-2}
nvidia-smi -L
for fsdp in on off; do
  timeout 280 $RUN --nproc_per_node="$NPROC" -m tpflash.train --config gpt-1.3b --tp="$TP" \
    --fsdp=$fsdp --data.path=@stdlib --data.include='*.py' --data.format=text --data.tokenizer=byte \
    --data.max_bytes=20000000 --model.vocab_size=50304 --train.batch_size=$((4 * NPROC / TP)) \
    --train.micro_batch_size=4 --train.warmup_steps=5 --train.steps="${STEPS:-40}" --train.eval_interval=1000 \
    --train.eval_batches=1 --checkpoint.dir= --log.interval=10 --log.progress=lines --log.dir="$OUT/dp_fsdp_$fsdp" \
    "$@" 2>&1 | grep -E "^layout|^\[train\]|Error|error" | sed "s/^/fsdp=$fsdp /"
done
