#!/usr/bin/env bash
# Same-run A/B of a training step on 2 GPUs: an older tree against the working tree,
# alternating twice at tp=2 ($TP2_MODELS, default gpt-1.3b,gpt-2.7b; impl $TP2_IMPL, default
# tpflash-nooverlap; $ROUNDS rounds, default 2) and at tp=1 ($TP1_MODELS, default gpt-1.3b; impl $TP1_IMPL, default tpflash;
# $TP1_ROUNDS rounds, default 1; TP1=0 skips it). With $MID set, a third tree runs between old and
# new in every round. ROUNDS=0 runs tp=1 only (one GPU is enough).
# Timings move between machines, so compare only within one call. Make the old tree here first:
#   mkdir -p .ab/old && git archive <rev> | tar -x -C .ab/old     (.ab ignored via .git/info/exclude)
# then run, on the GPU machine with .ab copied there: OUT=$OUT OLD=.ab/old bash benchmarks/ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OLD=${OLD:?set OLD to the old tree}; OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
bench() {  # tree tag nproc models impl
  local args="--steps 5 --warmup 2"  # older trees time the collectives alone first unless told not to
  local script="$1/benchmarks/bench_e2e.py"
  [ -f "$script" ] || script="$1/scripts/bench_e2e.py"  # where older trees keep it
  grep -q no-comm-probe "$script" && args="$args --no-comm-probe"
  PYTHONPATH=$1 timeout 150 $RUN --nproc_per_node=$3 $script $args --tp $3 --models $4 --impls $5 \
    --results "$OUT/ab_$2.jsonl" 2>&1 | grep "bench_e2e\]   " | sed "s/^/$2 /" | cut -c1-330
}
TP2_MODELS=${TP2_MODELS:-gpt-1.3b,gpt-2.7b} TP2_IMPL=${TP2_IMPL:-tpflash-nooverlap} TP1_IMPL=${TP1_IMPL:-tpflash}
for round in $(seq 1 ${ROUNDS:-2}); do
  bench "$OLD" old 2 $TP2_MODELS $TP2_IMPL
  [ -z "${MID:-}" ] || bench "$MID" mid 2 $TP2_MODELS $TP2_IMPL
  bench . new 2 $TP2_MODELS $TP2_IMPL
done
[ "${TP1:-1}" = 0 ] && exit 0
for round in $(seq 1 ${TP1_ROUNDS:-1}); do
  bench "$OLD" old 1 ${TP1_MODELS:-gpt-1.3b} $TP1_IMPL
  [ -z "${MID:-}" ] || bench "$MID" mid 1 ${TP1_MODELS:-gpt-1.3b} $TP1_IMPL
  bench . new 1 ${TP1_MODELS:-gpt-1.3b} $TP1_IMPL
done
