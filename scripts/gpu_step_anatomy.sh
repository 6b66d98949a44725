#!/usr/bin/env bash
# Where a step's time goes, kernel by kernel (2 x H200, nvidia-h200-x2), with the library's defaults:
# gpt-2.7b graphed at tp=2 (copy-engine overlap) and at tp=1 (the same kernels, unsplit), with rank 0's
# chrome trace of the tp=2 steps gzipped into $OUT; gpt-1.3b eager at tp=1 op by op (which op launched
# each kernel, with its input shapes).
#   OUT=<dir> bash scripts/gpu_step_anatomy.sh      (full listings in $OUT/*.txt)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
E2E="scripts/bench_e2e.py --steps 3 --warmup 2 --no-comm-probe --profile --profile-top ${TOP:-45} --results $OUT/rows.jsonl"
timeout 150 $RUN --nproc_per_node=2 $E2E --tp 2 --models gpt-2.7b --impls tpflash-graphs \
  --trace-dir /tmp/traces > "$OUT/tp2_graphs.txt" 2>&1
gzip -c /tmp/traces/trace_tp2_rank0.json > "$OUT/trace_tp2_rank0.json.gz" 2>/dev/null
timeout 120 $RUN --nproc_per_node=1 $E2E --tp 1 --models gpt-2.7b --impls tpflash-graphs > "$OUT/tp1_graphs.txt" 2>&1
[ -n "${NOOPS:-}" ] || timeout 150 $RUN --nproc_per_node=1 $E2E --tp 1 --models gpt-1.3b --impls tpflash \
  --profile-ops 50 > "$OUT/tp1_ops.txt" 2>&1
for f in tp2_graphs tp1_graphs tp1_ops; do
  [ -f "$OUT/$f.txt" ] || continue
  echo "== $f"; grep "GPU busy\|bench_e2e\]   \|Error" "$OUT/$f.txt" | grep -v "^\[rank1" | cut -c1-300
  grep "ops by\|^\[profile\]   .* ms  *[0-9]*x  aten\|^\[profile\]   .* ms  *[0-9]*x  [a-zA-Z_]\|^\[profile\]   *[0-9.]* ms  [^ ]" \
    "$OUT/$f.txt" | head -${TOP:-45} | cut -c1-200
done
