#!/usr/bin/env bash
# Overlap inside the CUDA graphs, variant by variant, on 2 GPUs (nvidia-h200-x2), gpt-2.7b at tp=2:
# serial collectives vs the "pieces" backend (k=1, k=2; NCCL's default channels and 8) and the
# "symm_mem" backend (copy engines), all captured; then where a tp=1 step's time goes (gpt-1.3b,
# tpflash-graphs and plain-compile, the top kernels), and the graphed-GPT gpu tests.
#   OUT=<dir> bash scripts/gpu_overlap_graphs.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
E2E="scripts/bench_e2e.py --steps 5 --warmup 2 --no-comm-probe"
MODEL=${MODEL:-gpt-2.7b}
rows() { grep "bench_e2e\]   \|Error\|error" | grep -v "^\[rank" | cut -c1-250 | sed "s/^/$1: /"; }
timeout 200 $RUN --nproc_per_node=1 $E2E --tp 1 --models gpt-1.3b --impls tpflash-graphs,plain-compile --profile \
  --profile-top 45 --results "$OUT/tp1.jsonl" > "$OUT/tp1_profile.txt" 2>&1
grep "bench_e2e\]   \|GPU busy" "$OUT/tp1_profile.txt" | cut -c1-250
timeout 120 $RUN --nproc_per_node=2 $E2E --tp 2 --models $MODEL --impls tpflash-graphs-serial,tpflash-graphs-overlap \
  --results "$OUT/tp2.jsonl" 2>&1 | rows "serial vs pieces k=4"
for variant in "1 0" "2 8" "1 8" "4 8" "2 4"; do
  set -- $variant
  CH=""; [ "$2" != 0 ] && CH="NCCL_MAX_NCHANNELS=$2"
  env TPFLASH_OVERLAP_PIECES=$1 $CH timeout 80 $RUN --nproc_per_node=2 $E2E --tp 2 --models $MODEL \
    --impls tpflash-graphs-overlap --results "$OUT/tp2.jsonl" 2>&1 | rows "pieces k=$1 ${CH:-default channels}"
done
TPFLASH_OVERLAP_BACKEND=symm_mem timeout 120 $RUN --nproc_per_node=2 $E2E --tp 2 --models $MODEL \
  --impls tpflash-graphs-overlap --results "$OUT/tp2.jsonl" 2>&1 | rows "symm_mem"
TPFLASH_TEST_TIMEOUT=90 timeout 200 python3 -m pytest -q -m gpu tests/distributed/test_graphed_blocks.py -rfE \
  -p no:cacheprovider > "$OUT/pytest.txt" 2>&1; tail -4 "$OUT/pytest.txt"
python3 scripts/bench_e2e.py --table-only --results "$OUT/tp2.jsonl"
