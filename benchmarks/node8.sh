#!/usr/bin/env bash
# A full node of 8 GPUs, one part per call (each within 10 minutes), every row of a part from one call:
#   OUT=<dir> bash benchmarks/node8.sh llama8b|fp8|tp|largest|stream|elastic
# llama8b  llama-3-8b at seq 8192 (1 sequence per dp rank) with selective recomputation: zero3 at dp=8 and at
#          tp=2 x dp=4, tp=8 alone (graphs), beside torchtitan at FSDP 8 and FSDP 4 x TP 2 with its selective AC
# fp8      llama-3-8b at seq 2048 (2 sequences per dp rank), zero3 dp=8 in bf16 and fp8 tensorwise (the weights
#          gathered in fp8), beside torchtitan FSDP 8 in bf16 and float8; one launch per row
# tp       TP efficiency: gpt-2.7b at tp=1, 2, 4, 8 (tpflash-graphs; compiled DTensor TP at tp=8), gpt-6.7b at tp=8
#          and at tp=4 x dp=2 (zero3)
# largest  the trainer on the largest of llama-3-70b, codellama-34b, llama-2-13b that trains here (zero3 dp=8,
#          full recomputation, 1 x 4096 tokens per rank, 10 steps): tokens/s/GPU, MFU, memory; then its Hugging
#          Face export (bf16 safetensors) to $CKPT/hf, timed in the [checkpoint] record
# stream   that export streamed back in by the trainer (model.init_from; load time in the [checkpoint] record),
#          5 steps, then the synchronous save of its whole training state where the disk holds it
# elastic  llama-3-8b trained 30 steps at tp=4 x dp=2 (zero3) and checkpointed, then resumed at tp=8 and at dp=8 to
#          step 60: the curves go on from the saved step
# The peers' wheels come from .whl/ (scripts/gpu_wheels.sh). On fewer GPUs a part runs what fits and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tpflash-node8}; mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/tpflash-node8-ckpt}; mkdir -p "$CKPT"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
RUN="python3 -m torch.distributed.run --standalone"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
TEXT=(--data.path=@stdlib "--data.include=*.py" --data.format=text --data.tokenizer=byte --data.max_bytes=20000000
  --train.warmup_steps=2 --train.eval_interval=1000 --train.eval_batches=1 --log.interval=5 --log.progress=lines
  --log.sample_tokens=0)
show() { grep -E "^layout|^model|^\[train\] step|^\[checkpoint\]|^resumed|^run summary|rror" | sed "s/^/$1 /"; }

bench() {  # bench <nproc> <timeout> bench_e2e args...: the rows, then nothing else
  local n=$1 t=$2; shift 2
  [ "$GPUS" -ge "$n" ] || { echo "skipped, needs $n GPUs: $*"; return; }
  timeout "$t" $RUN --nproc_per_node="$n" benchmarks/bench_e2e.py --results "$OUT/bench.jsonl" "$@" 2>&1 \
    | grep "bench_e2e\] [a-z]\|Error"
}

llama8b() {
  local e2e=(--models llama-3-8b --batch 1 --seq 8192 --steps 4 --warmup 2 --ac selective)
  bench 8 200 "${e2e[@]}" --tp 1 --impls tpflash-graphs@zero3,torchtitan@fsdp
  bench 8 200 "${e2e[@]}" --tp 2 --impls tpflash-graphs@zero3,torchtitan@fsdp
  bench 8 150 "${e2e[@]}" --tp 8 --impls tpflash-graphs
}

fp8() {
  local impl
  for impl in tpflash-fp8-tensorwise@zero3 tpflash-graphs@zero3 torchtitan-fp8@fsdp torchtitan@fsdp; do
    bench 8 150 --models llama-3-8b --batch 2 --seq 2048 --steps 5 --warmup 2 --tp 1 --impls "$impl"
  done
}

tp() {
  local e2e=(--models gpt-2.7b --steps 6 --warmup 2)
  for n in 1 2 4; do bench "$n" 90 "${e2e[@]}" --tp "$n" --impls tpflash-graphs; done
  bench 8 150 "${e2e[@]}" --tp 8 --impls tpflash-graphs,dtensor-compile
  bench 8 180 --models gpt-6.7b --steps 6 --warmup 2 --tp 8 --impls tpflash-graphs,dtensor-compile
  bench 8 120 --models gpt-6.7b --steps 6 --warmup 2 --tp 4 --impls tpflash-graphs@zero3
}

largest() {
  rm -rf "$CKPT/hf"
  local preset vocab
  for preset in llama-3-70b codellama-34b llama-2-13b; do
    vocab=$([ "$preset" = codellama-34b ] || [ "$preset" = llama-2-13b ] && echo 32000 || echo 128256)
    echo "== $preset, zero3 dp=$GPUS, full recomputation =="
    timeout 280 $RUN --nproc_per_node="$GPUS" -m tpflash.train --config llama-style --model.preset=$preset \
      --model.vocab_size=$vocab --model.activation_checkpointing=full --tp=1 --fsdp=zero3 "${TEXT[@]}" \
      --data.seq_len=4096 --train.micro_batch_size=1 --train.batch_size="$GPUS" --train.steps=10 \
      --checkpoint.dir= --checkpoint.export_hf="$CKPT/hf" --log.dir="$OUT/largest_$preset" 2>&1 | show "$preset" \
      | tee "$OUT/largest.log"
    grep -q "run summary" "$OUT/largest.log" && { du -sh "$CKPT/hf"; return; }
  done
}

stream() {
  [ -d "$CKPT/hf" ] || { echo "no export at $CKPT/hf: run the 'largest' part first"; return 1; }
  rm -rf "$CKPT/ck"
  df -h "$CKPT" | tail -1
  timeout 560 $RUN --nproc_per_node="$GPUS" -m tpflash.train --config llama-style --model.preset= --model.init_from="$CKPT/hf" \
    --model.activation_checkpointing=full --tp=1 --fsdp=zero3 "${TEXT[@]}" --data.seq_len=4096 \
    --train.micro_batch_size=1 --train.batch_size="$GPUS" --train.steps=5 --checkpoint.dir="$CKPT/ck" \
    --log.dir="$OUT/stream" 2>&1 | show stream
  rm -rf "$CKPT/ck"
}

elastic() {
  [ "$GPUS" -ge 8 ] || { echo "skipped, needs 8 GPUs: elastic (tp=4 x dp=2 resumed at tp=8 and dp=8)"; return; }
  rm -rf "$CKPT/el"
  local common=(--config llama-style --model.preset=llama-3-8b --model.vocab_size=128256 --fsdp=zero3 "${TEXT[@]}"
    --data.seq_len=2048 --train.micro_batch_size=1 --train.batch_size=8 --checkpoint.dir="$CKPT/el"
    --checkpoint.interval=30)
  timeout 200 $RUN --nproc_per_node="$GPUS" -m tpflash.train "${common[@]}" --tp=4 --train.steps=30 \
    --log.dir="$OUT/el_tp4" 2>&1 | show "tp=4 x dp=2"
  cp -r "$CKPT/el" "$CKPT/el_saved"
  timeout 170 $RUN --nproc_per_node="$GPUS" -m tpflash.train "${common[@]}" --tp=8 --train.steps=60 \
    --log.dir="$OUT/el_tp8" 2>&1 | show "resumed at tp=8"
  rm -rf "$CKPT/el"; mv "$CKPT/el_saved" "$CKPT/el"
  timeout 170 $RUN --nproc_per_node="$GPUS" -m tpflash.train "${common[@]}" --tp=1 --train.steps=60 \
    --log.dir="$OUT/el_dp8" 2>&1 | show "resumed at dp=8"
  rm -rf "$CKPT/el"
}

part=${1:?"which part: llama8b | fp8 | tp | largest | stream | elastic"}
case "$part" in
  llama8b|fp8|tp|largest|stream|elastic) nvidia-smi -L; "$part" ;;
  *) echo "unknown part $part: llama8b | fp8 | tp | largest | stream | elastic"; exit 2 ;;
esac
[ -f "$OUT/bench.jsonl" ] && python3 benchmarks/bench_e2e.py --table-only --results "$OUT/bench.jsonl"
exit 0
