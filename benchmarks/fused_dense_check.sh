#!/usr/bin/env bash
# The fused-dense GPU check in one command: build the extension, run its tests, run the benchmark.
#   OUT=/some/dir bash benchmarks/fused_dense_check.sh      (on a CUDA machine with nvcc; no network needed)
# Build: the documented `pip install --no-build-isolation --no-deps --use-pep517 -e .` (without
# --use-pep517 an older pip runs `setup.py develop`, which calls pip again with build isolation, i.e. the
# network). If that leaves no importable tpflash_fused_dense, the JIT build (TPFLASH_JIT_CUDA=1) is tried
# and its full compiler output printed.
# The tests and the benchmark run either way (on the PyTorch fallback where no build worked).
# Everything goes to $OUT/log; pip's verbose build log to $OUT/pip.log; the benchmark to $OUT/bench.*.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out/fused_dense}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MAX_JOBS="${MAX_JOBS:-8}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/tpflash_torch_extensions}"

step() { echo; echo "== $* [$(date -u +%H:%M:%S)]"; }

main() {
  step "environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
  $PY -c "import pathlib, sys; sys.path.insert(0, 'csrc/fused_dense'); import build_options as b
from torch.utils.cpp_extension import CUDA_HOME; print('CUDA_HOME', CUDA_HOME)
print(b.build_options(CUDA_HOME, pathlib.Path('/tmp/tpflash-cublas-include-check')))"

  step "build: pip install --no-build-isolation --no-deps --no-index --use-pep517 -e ."
  if timeout 200 $PY -m pip install --no-build-isolation --no-deps --no-index --use-pep517 -v -e . >"$OUT/pip.log" 2>&1; then
    echo "pip install: ok"
  else
    echo "pip install: FAILED (rc $?); the end of $OUT/pip.log:"
    grep -n -i -E "error|fatal" "$OUT/pip.log" | head -40
    tail -40 "$OUT/pip.log"
  fi
  if $PY -c "import torch, tpflash_fused_dense; print('import tpflash_fused_dense:', tpflash_fused_dense.__file__)"; then
    echo "built by pip"
  else
    step "JIT build (TPFLASH_JIT_CUDA=1)"
    if TPFLASH_JIT_CUDA=1 timeout 240 $PY -c "
from tpflash.kernels.fused_dense import extension_status, load_extension
print(extension_status()); raise SystemExit(load_extension() is None)"; then
      export TPFLASH_JIT_CUDA=1  # later processes load the cached JIT build
    else
      echo "no extension: the tests of the extension fail below and the benchmark runs the fallback only"
    fi
  fi

  step "tests"
  timeout 240 $PY -m pytest tests/kernels/test_fused_dense.py -q -rfEs -p no:cacheprovider

  step "benchmark"
  $PY benchmarks/fused_dense.py --json "$OUT/bench.json" --md "$OUT/bench.md" "$@"
  step "done"
}

main "$@" 2>&1 | tee "$OUT/log"
