#!/usr/bin/env bash
# Overlap on 2 GPUs (nvidia-h200-x2), in two calls that each fit the device tool's 10-minute limit:
#   OUT=<dir> bash scripts/gpu_overlap.sh check   NCCL tests (comm, overlap incl. symm_mem, linear),
#                                                 scripts/bench_overlap.py with and without
#                                                 CUDA_DEVICE_MAX_CONNECTIONS=1, tpflash at tp=1
#   OUT=<dir> bash scripts/gpu_overlap.sh e2e     bench_e2e at tp=2: overlap off, symm_mem, pieces
#                                                 k=2 with CUDA_DEVICE_MAX_CONNECTIONS=1, DTensor compiled
# Both append to $OUT/bench_e2e.jsonl; `python3 scripts/bench_e2e.py --table-only --results FILE` prints it.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export TPFLASH_TEST_TIMEOUT=60
E2E="scripts/bench_e2e.py --steps ${STEPS:-6} --warmup 2 --results $OUT/bench_e2e.jsonl --no-comm-probe"
case "${1:-check}" in
  check)
    { date -u; nvidia-smi topo -m; git log -1 --format='commit %H'; } > "$OUT/device.txt" 2>&1
    timeout 150 python3 -m pytest tests/distributed/test_comm.py tests/distributed/test_overlap.py \
      tests/distributed/test_linear.py tests/distributed/test_mlp.py -q -p no:cacheprovider -rfEs 2>&1 | tail -15
    timeout 100 $RUN --nproc_per_node=2 scripts/bench_overlap.py 2>&1 | grep -v Warn
    CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 100 $RUN --nproc_per_node=2 scripts/bench_overlap.py 2>&1 | grep -v Warn
    timeout 170 $RUN --nproc_per_node=1 $E2E --tp 1 --models gpt-2.7b,gpt-1.3b --impls tpflash 2>&1 | grep "^|\|bench_e2e\]" ;;
  e2e)
    timeout 240 $RUN --nproc_per_node=2 $E2E --tp 2 --models gpt-2.7b,gpt-1.3b --impls tpflash-nooverlap,dtensor-compile \
      --profile 2>&1 | grep -v "Warn\|warn"
    TPFLASH_OVERLAP_BACKEND=symm_mem timeout 150 $RUN --nproc_per_node=2 $E2E --tp 2 --models gpt-2.7b,gpt-1.3b \
      --impls tpflash --profile 2>&1 | grep -v "Warn\|warn"
    CUDA_DEVICE_MAX_CONNECTIONS=1 TPFLASH_OVERLAP_PIECES=2 timeout 120 $RUN --nproc_per_node=2 $E2E --tp 2 \
      --models gpt-2.7b,gpt-1.3b --impls tpflash 2>&1 | grep "^|\|bench_e2e\]"
    python3 scripts/bench_e2e.py --table-only --results "$OUT/bench_e2e.jsonl" --table "$OUT/table.md" ;;
esac
