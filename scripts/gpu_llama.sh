#!/usr/bin/env bash
# The Llama-style model on one GPU (llama-1b: RMSNorm, RoPE, SwiGLU, 32 q / 4 kv heads of dim 64):
# its kernels' tests, the GQA attention and SwiGLU kernels against their peers, then the training
# step against plain PyTorch (eager and compiled), with an older tree's tpflash row alternated in
# when $OLD names one (make it as scripts/gpu_ab.sh says; it runs with this tree's bench scripts
# copied in, so that the old library gets the same model). Compare rows only within one call.
#   OUT=$OUT [OLD=.ab/old] [ROUNDS=2] [TESTS=0] bash scripts/gpu_llama.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ "${TESTS:-1}" = 1 ]; then
  python3 -m pytest tests/kernels/test_swiglu.py tests/kernels/test_attention.py tests/kernels/test_concat_with_column_sum.py \
    tests/test_autocast_linear.py tests/models -m "gpu or not gpu" -q -p no:cacheprovider -n 4 2>&1 | tail -4
fi
python3 scripts/bench_kernels.py --attention-only --head-dims 64 --seqs 2048 --gqa 8 2>&1 | grep -v "^<!--"
python3 scripts/bench_kernels.py --no-attention --only swiglu 2>&1 | grep -v "^<!--"
bench() {  # tree tag impls
  PYTHONPATH=$1 timeout 300 $RUN --nproc_per_node=1 $1/scripts/bench_e2e.py --tp 1 --models llama-1b --steps 10 \
    --warmup 3 --no-comm-probe --impls $3 --results "$OUT/llama_$2.jsonl" 2>&1 | grep "bench_e2e\]   " \
    | sed "s/^/$2 /" | cut -c1-420
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  [ -z "${OLD:-}" ] || bench "$OLD" old tpflash
  impls=tpflash; [ "$round" = 1 ] && impls=tpflash,tpflash-graphs,plain,plain-compile
  bench . new $impls
done
PYTHONPATH=. python3 scripts/bench_e2e.py --table-only --results "$OUT/llama_new.jsonl"
