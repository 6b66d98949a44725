#!/usr/bin/env bash
# The trainer in each way of holding the model over dp (fsdp=on: FSDP2, eager blocks; zero1: AdamW's
# state sharded, CUDA-graphed blocks; zero3: everything sharded, CUDA-graphed blocks; off: replicated,
# DDP), on byte-level text from the standard library.
#   OUT=<dir> [PRESET=gpt-1.3b] [VOCAB=50304] [NPROC=4] [TP=2] [MODES="zero3 zero1 on off"] [MICRO=4] [SEQ=2048] \
#     [STEPS=40] bash benchmarks/dp_layouts.sh [extra trainer overrides]
# Each run: PRESET's model (tpflash.models.config presets, e.g. llama-1b, or llama-3-8b with VOCAB=128256)
# with a VOCAB-wide embedding and head (the byte tokenizer uses the first 256 ids), MICRO x SEQ
# tokens per rank and step, $STEPS steps logged every 10. Prints the layout line and the [train] lines
# of each run, tagged; metrics under $OUT/dp_<mode>. A layout that does not fit prints its error line.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tpflash-dp}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
NPROC=${NPROC:-4}
TP=${TP:-2}
MICRO=${MICRO:-4}
nvidia-smi -L
for fsdp in ${MODES:-zero3 zero1 on off}; do
  timeout "${RUN_TIMEOUT:-280}" $RUN --nproc_per_node="$NPROC" -m tpflash.train --config llama-style \
    --model.preset="${PRESET:-gpt-1.3b}" --model.vocab_size="${VOCAB:-50304}" --tp="$TP" --fsdp=$fsdp --data.path=@stdlib --data.include='*.py' \
    --data.format=text --data.tokenizer=byte --data.max_bytes=20000000 --data.seq_len="${SEQ:-2048}" \
    --train.batch_size=$((MICRO * NPROC / TP)) --train.micro_batch_size="$MICRO" --train.warmup_steps=5 \
    --train.steps="${STEPS:-40}" --train.eval_interval=1000 --train.eval_batches=1 --checkpoint.dir= \
    --log.interval=10 --log.progress=lines --log.dir="$OUT/dp_$fsdp" \
    "$@" 2>&1 | grep -E "^layout|^model|^\[train\]|Error|error" | sed "s/^/fsdp=$fsdp /"
done
