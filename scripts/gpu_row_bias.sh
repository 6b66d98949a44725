#!/usr/bin/env bash
# The copy_engine row layers' bias in the own rows' GEMM and chunked sends on 2 GPUs (nvidia-h200-x2):
# the overlap, comm and graphed-GPT gpu tests, then a same-call A/B of tpflash-graphs at tp=2 against
# the tree in .ab/old (device call with carry [".ab"]).
#   OUT=<dir> bash scripts/gpu_row_bias.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TPFLASH_TEST_TIMEOUT=90 timeout 200 python3 -m pytest -q -m gpu tests/distributed/test_comm.py \
  tests/distributed/test_overlap.py tests/distributed/test_graphed_blocks.py tests/distributed/test_linear.py \
  -k "copy_engine or default or epoch or row" -rfE -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
tail -3 "$OUT/pytest.txt"
OUT=$OUT OLD=.ab/old TP2_MODELS=${MODELS:-gpt-2.7b,gpt-1.3b} TP2_IMPL=tpflash-graphs TP1=0 bash scripts/gpu_ab.sh
