#!/usr/bin/env bash
# The lead's GPU validation on 2 GPUs (device kind nvidia-h200-x2), run from the repo root:
#   1. the distributed test suite over NCCL (2-rank tests on the 2 GPUs in bf16; 4-rank ones on gloo)
#   2. a short gpt2-medium run at tp=2 (tokens/s, MFU), checkpointed
#   3. the same checkpoint resumed at tp=1 on one GPU, continuing the loss curve
# Output under $OUT (or /tmp/tpflash-validate).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TPFLASH_TEST_TIMEOUT=120
OUT=${OUT:-/tmp/tpflash-validate}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

echo "== 1/3 distributed tests over NCCL =="
timeout 150 python3 -m pytest tests/distributed -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tests.log" | tail -25

CK=/tmp/tpflash-ck; rm -rf "$CK"
common=(--config configs/gpt2-medium.yaml --data.path=@stdlib --data.include='*.py' --data.format=text
        --data.tokenizer=byte --model.vocab_size=50304 --data.max_bytes=20000000 --train.batch_size=16
        --train.micro_batch_size=8 --train.warmup_steps=5 --train.eval_interval=1000 --checkpoint.dir=$CK
        --checkpoint.interval=20 --log.interval=5 --log.dir="$OUT/run")
echo "== 2/3 gpt2-medium, tp=2 on 2 GPUs, 20 steps =="
timeout 110 torchrun --standalone --nproc_per_node=2 -m tpflash.train "${common[@]}" --tp=2 --train.steps=20 \
  2>&1 | grep -v "^W1123\|OMP_NUM" | tee "$OUT/tp2.log" | tail -12
echo "== 3/3 resume that checkpoint at tp=1 on 1 GPU, steps 21-30 =="
timeout 100 torchrun --standalone --nproc_per_node=1 -m tpflash.train "${common[@]}" --tp=1 --train.steps=30 \
  2>&1 | grep -v "^W1123\|OMP_NUM" | tee "$OUT/tp1.log" | tail -8
