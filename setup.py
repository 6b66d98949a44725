"""tpflash: tensor-parallel transformer training over fused Triton kernels.

`pip install .` next to an existing torch (install the CPU or CUDA build you want first: pip
keeps it, since any torch>=2.4 satisfies the requirement). Triton is not a requirement: CUDA
builds of torch bring it, and on CPU the kernels' plain-PyTorch references run; the [test] extra
adds it for the tests, which run the kernels in Triton's CPU interpreter. The optional CUDA
extension in csrc/ is built only when CUDA and nvcc are present and TPFLASH_BUILD_CUDA is not 0.
"""
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup


def _ext_modules():
    if os.environ.get("TPFLASH_BUILD_CUDA", "1") == "0" or not os.path.isdir("csrc/fused_dense"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:  # no torch at build time: pure-Python install
        return [], {}
    if not torch.cuda.is_available() or CUDA_HOME is None:
        return [], {}
    # Sources, flags and cuBLASLt's header/library: shared with the JIT build (tpflash/kernels/fused_dense.py).
    sys.path.insert(0, os.path.join("csrc", "fused_dense"))
    from build_options import build_options
    try:
        opts = build_options(CUDA_HOME, Path("build") / "cublas_include", source_dir=Path("csrc") / "fused_dense")
    except FileNotFoundError as exc:
        print(f"tpflash: not building the CUDA extension: {exc}", file=sys.stderr)
        return [], {}
    ext = CUDAExtension("tpflash_fused_dense", sources=opts.sources, include_dirs=opts.include_dirs,
                        extra_compile_args={"cxx": opts.cxx_flags, "nvcc": opts.nvcc_flags},
                        extra_link_args=opts.ldflags)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()

setup(
    name="tpflash",
    version="0.1.0",
    description="Tensor-parallel, sequence-parallel and FSDP training of transformers over fused Triton kernels",
    packages=find_packages(include=["tpflash", "tpflash.*"]),
    package_data={"tpflash.configs": ["*.yaml"]},  # the trainer's configs, found by name (--config demo)
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "pyyaml"],
    extras_require={
        "test": ["pytest>=7", "triton>=3.0", "transformers", "safetensors"],
        "hf": ["transformers", "safetensors"],  # from_pretrained / save_pretrained / export-hf
        "logging": ["tensorboard", "tqdm"],
    },
    entry_points={"console_scripts": ["tpflash-train=tpflash.train.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
