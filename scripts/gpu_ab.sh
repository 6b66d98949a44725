#!/usr/bin/env bash
# Same-run A/B of a training step (nvidia-h200-x2): an older tree against the working tree,
# alternating twice at tp=2 (gpt-1.3b, gpt-2.7b, overlap off) and once at tp=1 (gpt-1.3b).
# Timings move between machines, so compare only within one call. Make the old tree here first:
#   mkdir -p .ab/old && git archive <rev> | tar -x -C .ab/old     (.ab ignored via .git/info/exclude)
# then call the device tool with carry [".ab"] and: OUT=$OUT OLD=.ab/old bash scripts/gpu_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OLD=${OLD:?set OLD to the old tree}; OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
ARGS="--steps 5 --warmup 2 --no-comm-probe"
bench() {  # tree tag nproc models impl
  PYTHONPATH=$1 timeout 150 $RUN --nproc_per_node=$3 $1/scripts/bench_e2e.py $ARGS --tp $3 --models $4 --impls $5 \
    --results "$OUT/ab_$2.jsonl" 2>&1 | grep "bench_e2e\]   " | sed "s/^/$2 /" | cut -c1-330
}
for round in 1 2; do
  bench "$OLD" old 2 gpt-1.3b,gpt-2.7b tpflash-nooverlap
  bench . new 2 gpt-1.3b,gpt-2.7b tpflash-nooverlap
done
bench "$OLD" old 1 gpt-1.3b tpflash
bench . new 1 gpt-1.3b tpflash
