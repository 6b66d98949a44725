#!/usr/bin/env bash
# The external peers of benchmarks/bench_e2e.py (benchmarks/e2e_external.py) as wheels in .whl/ (git-ignored),
# for a GPU host with Python 3.12 (manylinux x86_64) and torch 2.11+ on CUDA 13 that cannot reach
# the package index: run this where pip can, copy .whl/ over, install there, then benchmark.
#
#   torchtitan 0.2.2   its Llama 3 (0.3.0 needs a newer torch than 2.11: cannot import DataParallelMeshDims)
#   torchao 0.18.0     float8 training. Since 0.17 torchao is ABI-stable against torch >= 2.11 (pytorch/ao
#                      #2919, #4154): one wheel (cp310-abi3, its _C*.so linked to libcudart.so.13) for
#                      torch 2.11+ on CUDA 13. Float8 training needs none of the .so (mxfp8 and CUTLASS
#                      kernels); a failed load is a warning.
#   liger-kernel 0.8.5 Triton kernels (needs torch and triton)
#   torchtitan's imports a CUDA PyTorch install usually lacks: torchdata, tyro (+ docstring-parser,
#   typeguard). Not fetched: Hugging Face `datasets` (torchtitan imports it for its data loaders only;
#   e2e_external.stub_datasets stands in), tomli (python 3.12 has tomllib), and what a CUDA PyTorch
#   environment with transformers usually has (tensorboard, einops, pillow, tokenizers, fsspec,
#   transformers, triton, requests, urllib3): fetch those too if yours lacks them.
#
# On the GPU host, in the repository with .whl/ copied in:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 benchmarks/bench_e2e.py --models llama-1b --batch 4 --seq 2048
# (where pip reaches the index, `pip install torchtitan==0.2.2 torchao==0.18.0 liger-kernel==0.8.5`
# does the same). .whl/ must hold one version of each package (two stop the install): delete stale ones.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(torchtitan==0.2.2 torchao==0.18.0 liger-kernel==0.8.5
        torchdata==0.11.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
