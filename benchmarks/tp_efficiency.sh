#!/usr/bin/env bash
# TP efficiency on one host, every launch in this one call: tp=MAX on all GPUs; tp=1 on every GPU at
# once; each smaller tp on every group of GPUs at once; tp=MAX again. Then benchmarks/tp_efficiency.py
# sets each tp=N launch against the mean of its own GPUs' tp=1 (the GPUs differ by a few percent).
#   OUT=<dir> [TPS="2 4"] [MODELS=gpt-2.7b,llama-1b] [IMPL=tpflash-graphs] [AGAINST=<tree>] \
#     bash benchmarks/tp_efficiency.sh [more bench_e2e arguments, e.g. --steps 8 --warmup 3]
# Results: $OUT/tp{N}_gpus{a-b}[_b].jsonl (bench_e2e --results), logs beside them; TPS' largest is tp=MAX.
# AGAINST: another checkout of tpflash (e.g. `git worktree add <tree> HEAD~1`) to measure a change
# against, in the same call: the launches above with this tree ($OUT/this1), with that one
# ($OUT/against), with this one again ($OUT/this2), then each run's table and every layout's step
# time against that tree's. The tree launched in the middle has run up to 0.8% faster whichever it
# was (docs/performance.md, "TP efficiency"): for a change of under 1%, run it a second time from
# the other checkout with AGAINST= this one, and take both orders together.
set -uo pipefail
OUT=${OUT:-/tmp/tpflash-tp-efficiency}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: the launches cd
if [ -n "${AGAINST:-}" ]; then AGAINST=$(cd "$AGAINST" && pwd) || exit 2; fi
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RUN="python3 -m torch.distributed.run --standalone"
TPS=${TPS:-2 4}
MAX=$(printf '%s\n' $TPS | sort -n | tail -1)
GPUS=$(nvidia-smi -L | wc -l)
if [ "$MAX" -gt "$GPUS" ]; then echo "tp=$MAX needs $MAX GPUs; this host has $GPUS" >&2; exit 2; fi
B="benchmarks/bench_e2e.py --models ${MODELS:-gpt-2.7b,llama-1b} --impls ${IMPL:-tpflash-graphs} $*"

launch() {  # tp first-gpu tag: one bench_e2e launch on GPUs first..first+tp-1, results in $DIR
  local tp=$1 first=$2 last=$(( $2 + $1 - 1 )) name="tp$1_gpus$2-$(( $2 + $1 - 1 ))$3"
  CUDA_VISIBLE_DEVICES=$(seq -s, "$first" "$last") $RUN --nproc_per_node="$tp" $B --tp "$tp" \
    --results "$DIR/$name.jsonl" > "$DIR/$name.log" 2>&1 || echo "$name failed: $DIR/$name.log" >&2
}

every_group() {  # tp: one launch per group of tp GPUs, all at once
  for first in $(seq 0 "$1" $(( GPUS - $1 ))); do launch "$1" "$first" "" & done
  wait
}

launches() {  # tree dir: every launch of one table, with `tree`'s tpflash and benchmarks, results in `dir`
  mkdir -p "$2"
  ( cd "$1" && export PYTHONPATH=$PWD DIR=$2
    launch "$MAX" 0 ""
    every_group 1
    for tp in $(printf '%s\n' $TPS | sort -n); do
      [ "$tp" -gt 1 ] && [ "$tp" -lt "$MAX" ] && every_group "$tp"
    done
    launch "$MAX" 0 _b )
}

if [ -z "${AGAINST:-}" ]; then
  launches . "$OUT"
  python3 benchmarks/tp_efficiency.py "$OUT"
else
  [ -f "$AGAINST/benchmarks/bench_e2e.py" ] || { echo "AGAINST=$AGAINST is not a checkout of tpflash" >&2; exit 2; }
  launches . "$OUT/this1"
  launches "$AGAINST" "$OUT/against"
  launches . "$OUT/this2"
  python3 benchmarks/tp_efficiency.py "$OUT/this1" "$OUT/this2" --against "$OUT/against"
fi
