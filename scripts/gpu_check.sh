#!/usr/bin/env bash
# tpflash's GPU check, on whatever GPUs this machine has. Run from anywhere; output also under $OUT
# (default /tmp/tpflash-gpu-check). Each part fits in 10 minutes on 2 H200s.
#   bash scripts/gpu_check.sh tests   the gpu-marked tests (kernels, fused loss, autocast linear; 4 pytest
#                                     workers, so Triton compiles in parallel), then the distributed tests
#                                     over NCCL: 2-rank cases on 2 GPUs in bf16 (the copy-engine overlap
#                                     through peer memory, CUDA-graphed GPT), 4-rank cases on 4 GPUs,
#                                     skipped where there are fewer
#   bash scripts/gpu_check.sh bench   a short training-step table (benchmarks/bench_e2e.py): $MODELS (default
#                                     gpt-1.3b) at tp=1 (tpflash-graphs, plain-compile) and, on 2+ GPUs, at
#                                     tp=2 (tpflash-graphs, i.e. the library's defaults: the copy-engine
#                                     overlap where the GPUs map each other's memory; tpflash-graphs-serial;
#                                     dtensor-compile)
#   bash scripts/gpu_check.sh train   the trainer on 2 GPUs (--config demo) at tp=2 and at tp=1 x dp=2
#                                     (fsdp=auto: zero3): CUDA graphs on for 60 steps, checkpointed, then
#                                     resumed to 100
#   bash scripts/gpu_check.sh fp8     one GPU: the gpu-marked fp8 tests (fused casts against quantize bit for
#                                     bit, the _scaled_mm layers, CUDA-graph capture), then the casts' bandwidth
#                                     (benchmarks/fp8_cast.py)
#   bash scripts/gpu_check.sh fp8-bench  one GPU: the training step of $MODELS (default llama-1b) in bf16 and
#                                     each fp8 recipe beside torchao float8 + compile, torchtitan (bf16, float8)
#                                     and Liger; their wheels from .whl/ (scripts/gpu_wheels.sh) where present
#   bash scripts/gpu_check.sh fp8-accuracy  one GPU: benchmarks/fp8_accuracy.sh (bf16 and each recipe, 1,000
#                                     steps of a 1B model, at two seeds; MODES= and SEEDS= pick runs), then its
#                                     tables (each seed, and the mean over seeds) and PNG
#   bash scripts/gpu_check.sh dp      2 or 4 GPUs: zero1 against DDP and zero3 against FSDP2 over NCCL (NO_TESTS=1 skips them), then the
#                                     training step of $MODELS (default llama-1b; BATCH sequences per rank,
#                                     default 4) at tp=1 x dp=N (and tp=2 x dp=2 on 4 GPUs; TPS= picks) in each
#                                     way of holding the model over dp, one launch per layout (zero1 and zero3
#                                     graphed with their dp collectives inside the graphs, zero3 eager too;
#                                     DDP graphed and, at tp=1,
#                                     eager; FSDP2 eager; IMPLS= picks, as bench_e2e's impl@dp-mode list)
#                                     beside torchtitan (FSDP2, TP), its wheels from .whl/ where present;
#                                     PROFILE=1 adds each row's communication and exposed time
#   bash scripts/gpu_check.sh faults  2 and 4 GPUs: the fault suite over NCCL (tests/train/test_faults_nccl.py:
#                                     SIGKILL in a step and in a save, SIGTERM, a corrupt checkpoint, a stalled
#                                     rank, each against an uninterrupted run), one line per test; LAYOUTS=2gpu
#                                     or 4gpu runs one layout
#   bash scripts/gpu_check.sh         tests, then bench
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the symmetric-memory equivalents): some shared
# machines do not allow it. The fused-dense extension has its own check: benchmarks/fused_dense_check.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TPFLASH_TEST_TIMEOUT=${TPFLASH_TEST_TIMEOUT:-120}
OUT=${OUT:-/tmp/tpflash-gpu-check}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfE"
WORKERS=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # pytest-xdist, where installed
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %H' 2>/dev/null; } 2>&1 | tee "$OUT/device.txt"
[ "$GPUS" -ge 1 ] || { echo "no CUDA GPU visible"; exit 1; }

tests() {
  echo "== gpu-marked tests (kernels, fused loss, autocast linear) =="
  timeout 280 $PYTEST -m gpu tests/kernels tests/test_fused_linear_cross_entropy.py tests/test_autocast_linear.py \
    -k "not fused_dense" $WORKERS 2>&1 | tee "$OUT/kernels.log" | tail -15
  echo "== distributed tests over NCCL on $GPUS GPU(s) =="
  timeout 300 $PYTEST tests/distributed/test_linear.py tests/distributed/test_mlp.py tests/distributed/test_comm.py \
    tests/distributed/test_overlap.py tests/distributed/test_peer_collectives.py tests/distributed/test_block.py \
    tests/distributed/test_gpt.py tests/distributed/test_graphed_blocks.py tests/distributed/test_embedding.py 2>&1 | tee "$OUT/nccl.log" | tail -15
}

bench() {
  local e2e="benchmarks/bench_e2e.py --steps ${STEPS:-5} --warmup 2 --results $OUT/bench_e2e.jsonl"
  local models=${MODELS:-gpt-1.3b}
  echo "== training step, tp=1 =="
  timeout 200 $RUN --nproc_per_node=1 $e2e --tp 1 --models "$models" --impls tpflash-graphs,plain-compile \
    2>&1 | grep "bench_e2e\]\|Error"
  if [ "$GPUS" -ge 2 ]; then
    echo "== training step, tp=2 =="
    timeout 300 $RUN --nproc_per_node=2 $e2e --tp 2 --models "$models" \
      --impls tpflash-graphs,tpflash-graphs-serial,dtensor-compile 2>&1 | grep "bench_e2e\]\|Error"
  fi
  python3 benchmarks/bench_e2e.py --table-only --results "$OUT/bench_e2e.jsonl" --table "$OUT/table.md"
}

train() {
  [ "$GPUS" -ge 2 ] || { echo "train needs 2 GPUs"; return 1; }
  local tp ck
  for tp in 2 1; do  # tp=2 (graphs on); tp=1 x dp=2, where fsdp=auto picks zero3
    ck=$OUT/ckpt_tp$tp
    local t="$RUN --nproc_per_node=2 -m tpflash.train --config demo --tp=$tp --cuda_graphs=on"
    t="$t --log.sample_tokens=0 --log.progress=lines --checkpoint.dir=$ck --log.dir=$OUT/train_tp$tp"
    rm -rf "$ck"
    echo "== trainer, tp=$tp on 2 GPUs, CUDA graphs on: 60 steps, then resumed to 100 =="
    timeout 150 $t --train.steps=60 2>&1 | grep "layout\|step 60\|Error"
    timeout 150 $t --train.steps=100 2>&1 | grep "resumed\|step 100\|Error"
  done
}

fp8() {
  echo "== fp8: gpu-marked tests (fused casts, fp8 layers, a graphed fp8 GPT) =="
  timeout 280 $PYTEST -m gpu tests/kernels/test_fp8_cast.py tests/test_fp8_linear.py $WORKERS 2>&1 \
    | tee "$OUT/fp8_tests.log" | tail -15
  echo "== fp8: cast bandwidth =="
  timeout 200 python3 benchmarks/fp8_cast.py 2>&1 | tee "$OUT/fp8_cast.md" | tail -25
}

peer_wheels() {  # the external peers' wheels (scripts/gpu_wheels.sh), where .whl/ holds them
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: the external peers' rows will say 'not installed'"; return; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
}

fp8_bench() {
  peer_wheels
  local e2e="benchmarks/bench_e2e.py --models ${MODELS:-llama-1b} --batch 4 --seq 2048 --steps ${STEPS:-10} --warmup 3"
  e2e="$e2e --results $OUT/bench_e2e.jsonl"
  echo "== training step, one GPU: tpflash bf16 and fp8, plain-compile =="
  timeout 290 $RUN --nproc_per_node=1 $e2e --tp 1 \
    --impls tpflash-graphs,tpflash-fp8-rowwise,tpflash-fp8-tensorwise,tpflash-fp8-delayed,plain-compile 2>&1 | grep "bench_e2e\]\|Error"
  echo "== training step, one GPU: torchtitan, torchao float8, Liger =="
  timeout 290 $RUN --nproc_per_node=1 $e2e --tp 1 --impls torchtitan,torchtitan-fp8,torchao-fp8-compile,\
torchao-fp8-tensorwise-compile,liger 2>&1 | grep "bench_e2e\]\|Error"
  python3 benchmarks/bench_e2e.py --table-only --results "$OUT/bench_e2e.jsonl" --table "$OUT/table.md"
}

dp() {  # the ways of holding the model over dp, on 2 or 4 GPUs, beside torchtitan (its wheels from .whl/)
  [ "$GPUS" -ge 2 ] || { echo "dp needs 2 GPUs"; return 1; }
  peer_wheels
  if [ -z "${NO_TESTS:-}" ]; then
    echo "== over NCCL: zero1 against DDP, zero3 against FSDP2 in bf16 =="
    timeout 300 $PYTEST tests/distributed/test_zero_device.py tests/distributed/test_zero3_device.py 2>&1 \
      | tee "$OUT/zero_nccl.log" | tail -5
  fi
  local nproc=$(( GPUS >= 4 ? 4 : 2 )) tp
  local e2e="benchmarks/bench_e2e.py --models ${MODELS:-llama-1b} --batch ${BATCH:-4} --seq 2048 --steps ${STEPS:-8}"
  e2e="$e2e --warmup 3 --results $OUT/bench_dp.jsonl ${PROFILE:+--profile}"
  for tp in ${TPS:-1 $([ "$nproc" -ge 4 ] && echo 2)}; do
    echo "== training step, $nproc GPUs, tp=$tp x dp=$((nproc / tp)): zero1, zero3, DDP, FSDP2, torchtitan =="
    # zero1 and zero3 graphed (their dp collectives inside the graphs; zero3 eager too), DDP (eager: the trainer's choice at
    # tp=1; graphed), FSDP2 eager, torchtitan (FSDP2, and TP at tp > 1)
    local ddp="tpflash-graphs@replicate$([ "$tp" = 1 ] && echo ,tpflash@replicate)"
    timeout ${RUN_TIMEOUT:-290} $RUN --nproc_per_node=$nproc $e2e --tp $tp \
      --impls ${IMPLS:-torchtitan@fsdp,tpflash@fsdp,$ddp,tpflash-graphs@zero1,tpflash@zero3,tpflash-graphs@zero3} 2>&1 \
      | grep "bench_e2e\]\|Error"
  done
  python3 benchmarks/bench_e2e.py --table-only --results "$OUT/bench_dp.jsonl" --table "$OUT/table_dp.md"
}

faults() {  # the fault suite over NCCL on 2 and 4 GPUs (each layout skipped where there are fewer)
  [ "$GPUS" -ge 2 ] || { echo "faults needs 2 GPUs"; return 1; }
  echo "== the fault suite over NCCL =="
  timeout ${RUN_TIMEOUT:-580} python3 -m pytest -v -p no:cacheprovider -rfE -m gpu tests/train/test_faults_nccl.py \
    ${LAYOUTS:+-k "$LAYOUTS"} --durations=12 2>&1 | tee "$OUT/faults.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|s call|s setup"
}

fp8_accuracy() {
  OUT=$OUT/fp8_accuracy bash benchmarks/fp8_accuracy.sh
  python3 benchmarks/fp8_accuracy_plot.py "$OUT"/fp8_accuracy/seed* --png "$OUT/fp8_accuracy.png"
}

case "${1:-all}" in
  tests) tests ;;
  bench) bench ;;
  train) train ;;
  fp8) fp8 ;;
  fp8-bench) fp8_bench ;;
  fp8-accuracy) fp8_accuracy ;;
  dp) dp ;;
  faults) faults ;;
  all) tests; bench ;;
  *) echo "usage: bash scripts/gpu_check.sh [tests|bench|train|fp8|fp8-bench|fp8-accuracy|dp|faults]"; exit 2 ;;
esac
