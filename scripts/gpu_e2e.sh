#!/usr/bin/env bash
# The end-to-end benchmark on the GPU machine (2 x H200, `nvidia-h200-x2`): tp=1 on one GPU, then tp=2
# on two, both appending to $OUT/bench_e2e.jsonl; the last step prints one table of every row
# (scripts/bench_e2e.py documents the columns). Each phase has a time limit so that a slow compile in
# one cannot starve the other; rows finished before a limit are kept.
#   usage: OUT=/some/dir bash scripts/gpu_e2e.sh     (STEPS, WARMUP, T1, T2, T3 override the defaults)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
RESULTS=$OUT/bench_e2e.jsonl
COMMON="--steps ${STEPS:-8} --warmup ${WARMUP:-3} --results $RESULTS"
RUN="python3 -m torch.distributed.run --standalone"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)';
  nvidia-smi topo -m; git log -1 --format='commit %H'; } > "$OUT/device.txt" 2>&1

# tp=1, one GPU: the single-GPU baselines (and tpflash's tp=1 for its scaling efficiency)
timeout "${T1:-200}" $RUN --nproc_per_node=1 scripts/bench_e2e.py --tp 1 $COMMON \
  --models gpt-2.7b,gpt-1.3b --impls tpflash,plain,plain-compile 2>&1 | tee "$OUT/tp1.log"
# tp=2, two GPUs: tpflash with overlap on/off, PyTorch's DTensor TP eager/compiled, the collectives alone
# (--profile: 2 more steps under the profiler give each row its communication and exposed-communication time)
timeout "${T2:-200}" $RUN --nproc_per_node=2 scripts/bench_e2e.py --tp 2 $COMMON \
  --models gpt-2.7b,gpt-1.3b --impls tpflash,tpflash-nooverlap,dtensor-compile,dtensor --profile 2>&1 | tee "$OUT/tp2.log"
# overlap with 2 pieces per rank instead of 4 (the row's note says k), if time is left
TPFLASH_OVERLAP_PIECES=2 timeout "${T3:-60}" $RUN --nproc_per_node=2 scripts/bench_e2e.py --tp 2 $COMMON \
  --models gpt-2.7b --impls tpflash --no-comm-probe 2>&1 | tee "$OUT/tp2_k2.log"
python3 scripts/bench_e2e.py --table-only --results "$RESULTS" --table "$OUT/table.md"
