#!/usr/bin/env bash
# TP efficiency on one host, every launch in this one call: tp=MAX on all GPUs; tp=1 on every GPU at
# once; each smaller tp on every group of GPUs at once; tp=MAX again. Then benchmarks/tp_efficiency.py
# sets each tp=N launch against the mean of its own GPUs' tp=1 (the GPUs differ by a few percent).
#   OUT=<dir> [TPS="2 4"] [MODELS=gpt-2.7b,llama-1b] [IMPL=tpflash-graphs] bash benchmarks/tp_efficiency.sh \
#     [more bench_e2e arguments, e.g. --steps 8 --warmup 3]
# Results: $OUT/tp{N}_gpus{a-b}[_b].jsonl (bench_e2e --results), logs beside them; TPS' largest is tp=MAX.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tpflash-tp-efficiency}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
TPS=${TPS:-2 4}
MAX=$(printf '%s\n' $TPS | sort -n | tail -1)
GPUS=$(nvidia-smi -L | wc -l)
if [ "$MAX" -gt "$GPUS" ]; then echo "tp=$MAX needs $MAX GPUs; this host has $GPUS" >&2; exit 2; fi
B="benchmarks/bench_e2e.py --models ${MODELS:-gpt-2.7b,llama-1b} --impls ${IMPL:-tpflash-graphs} $*"

launch() {  # tp first-gpu tag: one bench_e2e launch on GPUs first..first+tp-1
  local tp=$1 first=$2 last=$(( $2 + $1 - 1 )) name="tp$1_gpus$2-$(( $2 + $1 - 1 ))$3"
  CUDA_VISIBLE_DEVICES=$(seq -s, "$first" "$last") $RUN --nproc_per_node="$tp" $B --tp "$tp" \
    --results "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1 || echo "$name failed: $OUT/$name.log" >&2
}

every_group() {  # tp: one launch per group of tp GPUs, all at once
  for first in $(seq 0 "$1" $(( GPUS - $1 ))); do launch "$1" "$first" "" & done
  wait
}

launch "$MAX" 0 ""
every_group 1
for tp in $(printf '%s\n' $TPS | sort -n); do
  [ "$tp" -gt 1 ] && [ "$tp" -lt "$MAX" ] && every_group "$tp"
done
launch "$MAX" 0 _b
python3 benchmarks/tp_efficiency.py "$OUT"
