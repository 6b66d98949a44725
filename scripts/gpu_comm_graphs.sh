#!/usr/bin/env bash
# The tp collectives inside the CUDA graphs by NCCL (TPFLASH_COMM_BACKEND=nccl) vs by the copy engines
# (TPFLASH_COMM_BACKEND=auto, the default; or copy_engine), on 2 GPUs (nvidia-h200-x2): the gpu tests
# of comm and of the graphed GPT, then tpflash-graphs at tp=2 alternating the two, for each model
# of $MODELS (default: gpt-2.7b twice, gpt-1.3b once).   OUT=<dir> bash scripts/gpu_comm_graphs.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export TPFLASH_TEST_TIMEOUT=60
timeout 150 python3 -m pytest -q tests/distributed/test_comm.py tests/distributed/test_graphed_blocks.py -m gpu \
  -p no:cacheprovider -rfE 2>&1 | tail -3
bench() {  # backend models
  TPFLASH_COMM_BACKEND=$1 timeout 100 $RUN --nproc_per_node=2 scripts/bench_e2e.py --steps 5 --warmup 2 \
    --no-comm-probe --tp 2 --models $2 --impls tpflash-graphs-serial --results "$OUT/$1.jsonl" 2>&1 \
    | grep "bench_e2e\]   \|Error" | cut -c1-260 | sed "s/^/$1: /"
}
for models in ${MODELS:-gpt-2.7b gpt-2.7b gpt-1.3b}; do
  bench nccl $models
  bench ${COPY:-auto} $models
done
