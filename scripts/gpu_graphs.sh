#!/usr/bin/env bash
# CUDA-graphed blocks on 2 GPUs (nvidia-h200-x2): their gpu tests (one GPU, NCCL tp=2 with overlap
# off and on), then tpflash-graphs with overlap off and on (pipelined inside the graphs) at tp=2.
#   OUT=<dir> bash scripts/gpu_graphs.sh [models]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
MODELS=${1:-gpt-1.3b,gpt-2.7b}
E2E="scripts/bench_e2e.py --steps 5 --warmup 2 --no-comm-probe --results $OUT/graphs.jsonl"
timeout 150 python3 -m pytest -q -m gpu tests/distributed/test_graphed_blocks.py -rfE -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
timeout 200 $RUN --nproc_per_node=2 $E2E --tp 2 --models $MODELS --impls tpflash-graphs-serial,tpflash-graphs-overlap \
  2>&1 | grep "bench_e2e\]   \|Error" | cut -c1-300
TPFLASH_OVERLAP_PIECES=2 timeout 100 $RUN --nproc_per_node=2 $E2E --tp 2 --models gpt-2.7b --impls tpflash-graphs-overlap \
  2>&1 | grep "bench_e2e\]   \|Error" | cut -c1-300
tail -5 "$OUT/pytest.txt"
python3 scripts/bench_e2e.py --table-only --results "$OUT/graphs.jsonl"
