#!/usr/bin/env bash
# How long a large model's checkpoints take on one node, against the disk's own bandwidth:
#   OUT=<dir> [CKPT=<dir on the disk to measure>] [PRESET=llama-3-8b] [VOCAB=128256] [NPROC=4] \
#     [PHASES="disk save cached load async dcp"] bash benchmarks/checkpoint_timing.sh
# disk:  dd, DISK_GB (8) GB with direct I/O: one writer, NPROC writers side by side (as the ranks write), one reader.
# save:  the trainer, sharded dp=NPROC (fsdp=on), 60 steps (its host staging buffers page-locked in the
#        background meanwhile), then its synchronous save of model + AdamW state.
# cached: the same save with --checkpoint.direct_io=false (every file through the page cache).
# load:  the same checkpoint resumed at tp=2 x dp=NPROC/2 (fsdp=zero1), then the Hugging Face export.
# async: sharded dp=NPROC, 300 steps, an async save at step 150, the final one synchronous (room for two
#        checkpoints on CKPT's disk): the staging time, and the steps' time while the save is written.
# dcp:   the peer: PyTorch DCP's own dcp.save and dcp.async_save of the same model and AdamW state at
#        sharded dp=NPROC (benchmarks/checkpoint_dcp_peer.py, as torchtitan saves).
# Every trainer phase logs [checkpoint] records (save_s / staged_s / write_s / load_s / export_s, GB, GB/s);
# `python benchmarks/checkpoint_table.py $OUT` prints the table. Data: byte-level standard-library text.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tpflash-ckpt}; mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/tpflash-ckpt-bench}; mkdir -p "$CKPT"
NPROC=${NPROC:-4}
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node=$NPROC"
TRAIN=(-m tpflash.train --config llama-style --model.preset="${PRESET:-llama-3-8b}" --model.vocab_size="${VOCAB:-128256}"
  --data.path=@stdlib "--data.include=*.py" --data.format=text --data.tokenizer=byte --data.max_bytes=20000000
  --data.seq_len=2048 --train.micro_batch_size=2 --train.warmup_steps=2 --train.eval_interval=1000
  --train.eval_batches=1 --log.interval=1 --log.progress=lines --checkpoint.dir="$CKPT/ck")
show() { grep -E "^layout|^\[checkpoint\]|^\[train\] step [0-9]*0 |^resumed|^run summary|rror" | sed "s/^/$1 /"; }

disk() {
  df -h "$CKPT" | tail -1
  local gb=${DISK_GB:-8} n
  echo "disk write, 1 writer: $(dd if=/dev/zero of="$CKPT/dd0" bs=64M count=$((gb * 16)) oflag=direct 2>&1 | tail -1)"
  echo "disk read, 1 reader: $(dd if="$CKPT/dd0" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1)"
  rm -f "$CKPT"/dd*
  local start=$(date +%s.%N)
  for n in $(seq 1 "$NPROC"); do
    dd if=/dev/zero of="$CKPT/dd$n" bs=64M count=$((gb * 16 / NPROC)) oflag=direct status=none &
  done
  wait
  echo "disk write, $NPROC writers: $(python3 -c "print(f'{$gb * 1.073741824 / ($(date +%s.%N) - $start):.2f} GB/s')")"
  rm -f "$CKPT"/dd*
}

save() {  # [extra trainer arguments]; logs under the phase being run (save or cached)
  rm -rf "$CKPT/ck"
  timeout 420 $RUN "${TRAIN[@]}" --tp=1 --fsdp=on --train.batch_size=$((2 * NPROC)) --train.steps=60 \
    --log.dir="$OUT/$phase" "$@" 2>&1 | show "$phase"
  du -sh "$CKPT/ck"
}

cached() {
  save --checkpoint.direct_io=false
}

load() {
  rm -rf "$CKPT/hf"
  timeout 420 $RUN "${TRAIN[@]}" --tp=2 --fsdp=zero1 --train.batch_size=$NPROC --train.steps=3 \
    --checkpoint.export_hf="$CKPT/hf" --log.dir="$OUT/load" 2>&1 | show load
  du -sh "$CKPT/hf"
  rm -rf "$CKPT/hf" "$CKPT/ck"
}

async() {
  rm -rf "$CKPT/ck"
  timeout 560 $RUN "${TRAIN[@]}" --tp=1 --fsdp=on --train.batch_size=$((2 * NPROC)) --train.steps=300 --checkpoint.interval=150 \
    --checkpoint.async_save=true --checkpoint.keep=1 --log.dir="$OUT/async" 2>&1 | show async
  rm -rf "$CKPT/ck"
}

dcp() {
  timeout 420 $RUN benchmarks/checkpoint_dcp_peer.py --preset "${PRESET:-llama-3-8b}" --vocab "${VOCAB:-128256}" \
    --dir "$CKPT/dcp" --out "$OUT/dcp" 2>&1 | grep -E "^\[dcp peer\]|rror"
  rm -rf "$CKPT/dcp"
}

nvidia-smi -L
for phase in ${PHASES:-disk save load async dcp}; do
  echo "== $phase =="
  $phase 2>&1 | tee -a "$OUT/$phase.log"
done
