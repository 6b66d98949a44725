#!/usr/bin/env bash
# Where the non-GEMM time of a step goes, kernel by kernel and op by op (2 x H200, nvidia-h200-x2):
# gpt-1.3b at tp=1, eager (ops with their input shapes: which op launched each kernel); gpt-2.7b at
# tp=2, graphed with serial collectives and with the symm_mem overlap backend (top kernels).
#   OUT=<dir> bash scripts/gpu_step_anatomy.sh      (full listings in $OUT/*.txt)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
E2E="scripts/bench_e2e.py --steps 3 --warmup 2 --no-comm-probe --profile --profile-top 60 --results $OUT/rows.jsonl"
timeout 150 $RUN --nproc_per_node=1 $E2E --tp 1 --models gpt-1.3b --impls tpflash --profile-ops 60 > "$OUT/tp1_ops.txt" 2>&1
timeout 150 $RUN --nproc_per_node=2 $E2E --tp 2 --models gpt-2.7b --impls tpflash-graphs > "$OUT/tp2_serial.txt" 2>&1
TPFLASH_OVERLAP_BACKEND=symm_mem timeout 150 $RUN --nproc_per_node=2 $E2E --tp 2 --models gpt-2.7b \
  --impls tpflash-graphs-overlap > "$OUT/tp2_symm_mem.txt" 2>&1
for f in tp1_ops tp2_serial tp2_symm_mem; do
  echo "== $f"; grep "GPU busy\|bench_e2e\]   " "$OUT/$f.txt" | cut -c1-300
  grep "ops by\|^\[profile\]   .* ms  *[0-9]*x  aten\|^\[profile\]   .* ms  *[0-9]*x  [a-zA-Z_]" "$OUT/$f.txt" | head -45 | cut -c1-230
done
