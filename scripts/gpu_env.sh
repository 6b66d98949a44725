# Sourced by scripts/gpu_*.sh: run from the repository root with it on PYTHONPATH, with the settings
# every run on the device machines keeps (NVLink multicast off: the device tool's KINDS.md), $OUT
# created (default bench_out) and $RUN = torchrun.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone"
