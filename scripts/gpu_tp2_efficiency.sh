#!/usr/bin/env bash
# One 2-GPU call (nvidia-h200-x2, about 6 minutes): the NCCL/peer-memory tests of the TP core,
# then gpt-2.7b's TP efficiency (tpflash-graphs at tp=1 and tp=2), optionally beside an older tree,
# then one profiled tp=2 step with rank 0's chrome trace kept under $OUT/trace, then (PEERS=0 skips it)
# PyTorch's compiled DTensor TP at tp=2 on the same model: about 6 minutes in all, so that a kind lent
# for one call only still answers the issue's tp=2 questions.
#   OUT=<dir> [OLD=.ab/old] [PEERS=0] bash scripts/gpu_tp2_efficiency.sh
# Make the old tree first (mkdir -p .ab/old && git archive <rev> | tar -x -C .ab/old) and carry .ab.
# The full peers' table (both models, plain PyTorch at tp=1) is `gpu_e2e.sh table` (a 10-minute call).
# Analyse the trace here, on CPU: python3 scripts/trace_categories.py <trace>.json.gz --list other,barrier
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export TPFLASH_TEST_TIMEOUT=60
{ date -u; nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv; nvidia-smi topo -m; } 2>&1 | tee "$OUT/device.txt"
echo "== 2-GPU tests =="
timeout 230 python3 -m pytest tests/distributed/test_linear.py tests/distributed/test_mlp.py tests/distributed/test_overlap.py \
  tests/distributed/test_gpt.py tests/distributed/test_graphed_blocks.py tests/distributed/test_block.py \
  tests/distributed/test_peer_collectives.py tests/distributed/test_comm.py \
  -q -p no:cacheprovider -rfE -x 2>&1 | tee "$OUT/tests.log" | tail -12
bench() {  # tree tag nproc [extra bench_e2e args]
  local tree=$1 tag=$2 n=$3; shift 3
  PYTHONPATH=$tree timeout ${BENCH_TIMEOUT:-110} $RUN --nproc_per_node=$n $tree/scripts/bench_e2e.py --steps 6 --warmup 2 \
    --no-comm-probe --tp $n --models gpt-2.7b --impls tpflash-graphs --results "$OUT/e2e_$tag.jsonl" "$@" 2>&1 \
    | tee -a "$OUT/bench.log" | grep "bench_e2e\]   \|Error\|profile\]" | grep -v "^\[profile\]   .*ms .*x  " \
    | sed "s/^/$tag tp=$n: /" | cut -c1-300
}
echo "== gpt-2.7b tpflash-graphs =="
bench . new 1
bench . new 2
if [ -n "${OLD:-}" ]; then bench "$OLD" old 2; bench "$OLD" old 1; fi
mkdir -p "$OUT/trace"
bench . new 2 --profile --trace-dir "$OUT/trace"
[ "${PEERS:-1}" = 0 ] || BENCH_TIMEOUT=200 bench . peers 2 --impls dtensor-compile
gzip -f "$OUT"/trace/*.json 2>/dev/null; ls -la "$OUT/trace"
