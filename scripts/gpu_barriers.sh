#!/usr/bin/env bash
# The copy-engine collectives' single-barrier graph epochs, the row backward by rank and the column
# backward's re-gather on 2 GPUs (nvidia-h200-x2): their gpu tests, then a same-call A/B of
# tpflash-graphs at tp=2 (gpt-2.7b, gpt-1.3b): old = .ab/old, mid = .ab/mid, new = this tree.
#   OUT=<dir> bash scripts/gpu_barriers.sh     (device call with carry [".ab"])
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TPFLASH_TEST_TIMEOUT=90 timeout 200 python3 -m pytest -q -m gpu tests/distributed/test_comm.py \
  tests/distributed/test_overlap.py tests/distributed/test_graphed_blocks.py tests/test_autocast_linear.py \
  -k "copy_engine or default or epoch or row_blocks or fp32_output" -rfE -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
tail -5 "$OUT/pytest.txt"
OUT=$OUT OLD=.ab/old MID=.ab/mid TP2_MODELS=${MODELS:-gpt-2.7b,gpt-1.3b} TP2_IMPL=tpflash-graphs TP1=0 bash scripts/gpu_ab.sh
