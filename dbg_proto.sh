set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
RUN="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
for proto in default Simple LL128; do
  if [ $proto = default ]; then unset NCCL_PROTO; else export NCCL_PROTO=$proto; fi
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING timeout 120 $RUN scripts/bench_e2e.py --steps 5 --warmup 2 --tp 2 --models gpt-1.3b,gpt-2.7b \
    --impls tpflash-graphs --results $OUT/proto_$proto.jsonl 2>&1 | grep "bench_e2e\]   \|collectives-alone\|Error" | cut -c1-260 | sed "s/^/$proto /"
  python3 scripts/bench_e2e.py --table-only --results $OUT/proto_$proto.jsonl | grep "gpt" | sed "s/^/$proto /"
done
