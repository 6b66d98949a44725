#!/usr/bin/env bash
# The copy_engine overlap backend (tpflash.parallel.peer_overlap) on 2 GPUs (nvidia-h200-x2): its gpu
# tests (layers, block, graphed GPT) and the copy-engine collectives', then tpflash-graphs at tp=2 with
# serial collectives (the default: copy engines, not overlapped) against tpflash-graphs-overlap with
# TPFLASH_OVERLAP_BACKEND=copy_engine, alternating, for each model of $MODELS.
#   OUT=<dir> bash scripts/gpu_peer_overlap.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
TPFLASH_TEST_TIMEOUT=90 timeout 240 python3 -m pytest -q -m gpu tests/distributed/test_overlap.py \
  tests/distributed/test_comm.py tests/distributed/test_graphed_blocks.py -k "copy_engine or default" -rfE \
  -p no:cacheprovider > "$OUT/pytest.txt" 2>&1; tail -4 "$OUT/pytest.txt"
E2E="scripts/bench_e2e.py --steps 5 --warmup 2 --no-comm-probe --tp 2"
rows() { grep "bench_e2e\]   \|Error\|error" | grep -v "^\[rank" | cut -c1-250 | sed "s/^/$1: /"; }
for models in ${MODELS:-gpt-2.7b gpt-1.3b gpt-2.7b}; do
  timeout 100 $RUN --nproc_per_node=2 $E2E --models $models --impls tpflash-graphs-serial \
    --results "$OUT/tp2.jsonl" 2>&1 | rows serial
  TPFLASH_OVERLAP_BACKEND=copy_engine timeout 100 $RUN --nproc_per_node=2 $E2E --models $models \
    --impls tpflash-graphs-overlap --results "$OUT/tp2.jsonl" 2>&1 | rows copy_engine
done
python3 scripts/bench_e2e.py --table-only --results "$OUT/tp2.jsonl"
