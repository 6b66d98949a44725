#!/usr/bin/env bash
# The kernels' GPU check and benchmark, for one run on the device machine (repo root as cwd):
# the gpu-marked kernel tests, then scripts/bench_kernels.py's table. Output also in $OUT/log.
set -o pipefail
export PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/tpflash_gpu_out}"
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout "${TEST_TIMEOUT:-280}" python3 -m pytest -m gpu tests/kernels tests/test_fused_linear_cross_entropy.py \
    -q -p no:cacheprovider --durations=8 2>&1
  echo "pytest rc=$?"
  timeout "${BENCH_TIMEOUT:-240}" python3 scripts/bench_kernels.py "$@" 2>&1
  echo "bench rc=$?"
} | tee "$OUT/log"
