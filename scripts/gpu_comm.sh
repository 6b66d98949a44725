#!/usr/bin/env bash
# Copy-engine collectives on 2 GPUs (nvidia-h200-x2), one call:
#   NCCL tests of tpflash.parallel.comm (incl. the copy_engine backend against NCCL),
#   scripts/bench_collectives.py (NCCL vs copy engine, alone and beside a GEMM),
#   bench_e2e at tp=2 with TPFLASH_COMM_BACKEND=nccl and =copy_engine, and tpflash at tp=1.
#   OUT=<dir> bash scripts/gpu_comm.sh [models]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
MODELS=${1:-gpt-1.3b,gpt-2.7b}
E2E="scripts/bench_e2e.py --steps ${STEPS:-6} --warmup 2 --no-comm-probe --results $OUT/bench_e2e.jsonl --models $MODELS"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; git log -1 --format='commit %H'; } > "$OUT/device.txt" 2>&1
timeout 150 python3 -m pytest tests/distributed/test_comm.py -q -p no:cacheprovider -rfEs 2>&1 | tail -8
timeout 120 $RUN --nproc_per_node=2 scripts/bench_collectives.py 2>&1 | grep -v "Warn\|warn"
for BACKEND in copy_engine nccl; do
  echo "=== TPFLASH_COMM_BACKEND=$BACKEND"
  TPFLASH_COMM_BACKEND=$BACKEND timeout 200 $RUN --nproc_per_node=2 $E2E --tp 2 --impls tpflash-nooverlap 2>&1 | grep "^|\|bench_e2e\]\|Error\|error"
done
timeout 150 $RUN --nproc_per_node=1 $E2E --tp 1 --impls tpflash 2>&1 | grep "bench_e2e\]\|Error"
python3 scripts/bench_e2e.py --table-only --results "$OUT/bench_e2e.jsonl" --table "$OUT/table.md"
