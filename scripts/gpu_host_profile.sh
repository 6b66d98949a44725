#!/usr/bin/env bash
# Where a training step's time goes, host versus device (nvidia-h200-x2): gpt-1.3b at tp=1 and tp=2
# under bench_e2e --profile (kernel categories, host ops, blocking CUDA calls), --cprofile (Python
# functions of one step) and a chrome trace per rank read by scripts/trace_lag.py (launch lag, idle GPU).
#   OUT=<dir> bash scripts/gpu_host_profile.sh [model] [impl]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
MODEL=${1:-gpt-1.3b}; IMPL=${2:-tpflash-nooverlap}
E2E="scripts/bench_e2e.py --steps 4 --warmup 2 --no-comm-probe --results $OUT/bench_e2e.jsonl --models $MODEL --profile --cprofile 30"
for TP in 2 1; do
  impl=$IMPL; [ "$TP" = 1 ] && impl=tpflash
  echo "=== $MODEL $impl tp=$TP"
  timeout 200 $RUN --nproc_per_node=$TP $E2E --tp $TP --impls $impl --trace-dir /tmp/traces 2>&1 | grep -v "Warn\|warn"
  python3 scripts/trace_lag.py /tmp/traces/trace_tp${TP}_rank*.json
done
gzip -c /tmp/traces/trace_tp2_rank0.json > "$OUT/trace_tp2_rank0.json.gz"
ls -la "$OUT"
