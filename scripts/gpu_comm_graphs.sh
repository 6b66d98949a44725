#!/usr/bin/env bash
# The tp collectives by NCCL vs by the copy engines (TPFLASH_COMM_BACKEND=copy_engine), both inside
# the CUDA graphs, on 2 GPUs (nvidia-h200-x2): the gpu tests of both, then tpflash-graphs at tp=2
# alternating the two backends (gpt-2.7b twice, gpt-1.3b once).   OUT=<dir> bash scripts/gpu_comm_graphs.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export TPFLASH_TEST_TIMEOUT=60
timeout 150 python3 -m pytest -q tests/distributed/test_comm.py tests/distributed/test_graphed_blocks.py -m gpu \
  -p no:cacheprovider -rfE 2>&1 | tail -3
bench() {  # backend models
  TPFLASH_COMM_BACKEND=$1 timeout 100 $RUN --nproc_per_node=2 scripts/bench_e2e.py --steps 5 --warmup 2 \
    --no-comm-probe --tp 2 --models $2 --impls tpflash-graphs --results "$OUT/$1.jsonl" 2>&1 \
    | grep "bench_e2e\]   \|Error" | cut -c1-260 | sed "s/^/$1: /"
}
for models in gpt-2.7b gpt-2.7b gpt-1.3b; do
  bench nccl $models
  bench copy_engine $models
done
