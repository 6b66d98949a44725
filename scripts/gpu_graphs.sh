#!/usr/bin/env bash
# CUDA-graphed blocks on the GPU (nvidia-h200-x2): their gpu tests (one GPU and NCCL tp=2), then
# tpflash eager (overlap off) against tpflash-graphs in one run at tp=2 and tp=1.
#   OUT=<dir> bash scripts/gpu_graphs.sh [models]
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
MODELS=${1:-gpt-1.3b,gpt-2.7b}
RUN="python3 -m torch.distributed.run --standalone"
E2E="scripts/bench_e2e.py --steps 5 --warmup 2 --no-comm-probe --results $OUT/graphs.jsonl --models $MODELS"
timeout 170 python3 -m pytest -q -m gpu tests/distributed/test_graphed_blocks.py tests/kernels/test_norm.py -x 2>&1 | tail -15
timeout 220 $RUN --nproc_per_node=2 $E2E --tp 2 --impls tpflash-nooverlap,tpflash-graphs 2>&1 | grep -v -i warn | tail -12
timeout 200 $RUN --nproc_per_node=1 $E2E --tp 1 --impls tpflash,tpflash-graphs 2>&1 | grep -v -i warn | tail -12
