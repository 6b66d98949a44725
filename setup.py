"""tpflash: tensor-parallel transformer training over fused Triton kernels.

`pip install -e .` next to an existing torch (torch is not pulled in here when one is
importable, so a CPU or CUDA build chosen by the user stays). The optional CUDA extension in
csrc/ is built only when CUDA and nvcc are present and TPFLASH_BUILD_CUDA is not 0.
"""
import os

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
    ext = CUDAExtension("tpflash_fused_dense", sources=["csrc/fused_dense/fused_dense.cpp",
                                                       "csrc/fused_dense/fused_dense_cuda.cu"],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-arch=sm_90"]})
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()

setup(
    name="tpflash",
    version="0.1.0",
    description="Tensor-parallel, sequence-parallel and FSDP training of transformers over fused Triton kernels",
    packages=find_packages(include=["tpflash", "tpflash.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "einops", "numpy", "pyyaml"],
    extras_require={
        "test": ["pytest>=7", "triton>=3.0"],
        "hf": ["transformers", "safetensors"],
        "logging": ["tensorboard", "tqdm", "rich"],
    },
    entry_points={"console_scripts": ["tpflash-train=tpflash.train.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
