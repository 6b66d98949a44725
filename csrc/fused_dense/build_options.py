"""How to build the fused-dense extension: sources, flags, and where cuBLASLt's header and library are.

Used by setup.py (`pip install --no-build-isolation -e .`) and by the JIT build in
tpflash/kernels/fused_dense.py, so the two always compile the same thing. Standard library only.

cuBLASLt may come with the CUDA toolkit (CUDA_HOME/include/cublasLt.h) or only with PyTorch's pip
wheels (site-packages/nvidia/cu13/include, .../lib/libcublasLt.so.13, no unversioned .so). In the
second case the header is linked into a private include folder holding only cublas headers, so that
the wheel's other CUDA headers never shadow the toolkit's that nvcc was built with.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sys
from pathlib import Path
from typing import List, Optional

NAME = "tpflash_fused_dense"
HERE = Path(__file__).resolve().parent
SOURCE_NAMES = ("fused_dense.cpp", "fused_dense_cuda.cu")
# Compute capabilities to build for, e.g. TPFLASH_CUDA_ARCHS="80;90"; Hopper (sm_90) by default.
DEFAULT_ARCHS = "90"
_CUBLAS_HEADERS = ("cublasLt.h", "cublas_api.h")


@dataclasses.dataclass
class BuildOptions:
    """Arguments for CUDAExtension / torch.utils.cpp_extension.load."""
    sources: List[str]
    include_dirs: List[str]
    cxx_flags: List[str]
    nvcc_flags: List[str]
    ldflags: List[str]


def nvcc_arch_flags(archs: Optional[str] = None) -> List[str]:
    archs = archs or os.environ.get("TPFLASH_CUDA_ARCHS", DEFAULT_ARCHS)
    flags = []
    for arch in archs.replace(",", ";").split(";"):
        arch = arch.strip().replace(".", "")
        if arch:
            flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _site_dirs() -> List[Path]:
    dirs = [Path(p) for p in sys.path if p and Path(p).is_dir()]
    try:
        import site
        dirs += [Path(p) for p in site.getsitepackages() + [site.getusersitepackages()]]
    except Exception:  # a virtualenv without site.getsitepackages
        pass
    return list(dict.fromkeys(dirs))


def _toolkit_dirs(cuda_home: str, kind: str) -> List[Path]:
    """CUDA_HOME/include (kind="include") or CUDA_HOME/lib64 (kind="lib"), plus the targets/ layout."""
    names = ["include"] if kind == "include" else ["lib64", "lib"]
    roots = [Path(cuda_home)] + [Path(p) for p in glob.glob(os.path.join(cuda_home, "targets", "*"))]
    return [root / name for root in roots for name in names]


def _wheel_dirs(kind: str) -> List[Path]:
    """site-packages/nvidia/<pkg>/include or .../lib of the NVIDIA pip wheels (cu13, cublas, ...)."""
    return [Path(p) for site_dir in _site_dirs() for p in sorted(glob.glob(str(site_dir / "nvidia" / "*" / kind)))]


def find_cublaslt_header(cuda_home: str) -> Optional[Path]:
    for directory in _toolkit_dirs(cuda_home, "include") + _wheel_dirs("include"):
        if (directory / "cublasLt.h").is_file():
            return directory
    return None


def find_cublaslt_library(cuda_home: str) -> Optional[Path]:
    """The unversioned libcublasLt.so of the toolkit, else the highest versioned one of a wheel."""
    for directory in _toolkit_dirs(cuda_home, "lib") + _wheel_dirs("lib"):
        if (directory / "libcublasLt.so").is_file():
            return directory / "libcublasLt.so"
        versioned = sorted(directory.glob("libcublasLt.so.*"))
        if versioned:
            return versioned[-1]
    return None


def _private_include_dir(header_dir: Path, scratch: Path) -> Path:
    """A folder of links to the cublas headers of header_dir alone (see the module docstring)."""
    scratch.mkdir(parents=True, exist_ok=True)
    for name in _CUBLAS_HEADERS:
        link = scratch / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(header_dir / name)
    return scratch


def build_options(cuda_home: str, scratch: Path, source_dir: Optional[Path] = None) -> BuildOptions:
    """Flags to build the extension against the toolkit at cuda_home. scratch: a writable folder for
    the private include links. Raises FileNotFoundError naming what is missing."""
    header_dir = find_cublaslt_header(cuda_home)
    library = find_cublaslt_library(cuda_home)
    if header_dir is None or library is None:
        missing = [n for n, p in (("cublasLt.h", header_dir), ("libcublasLt.so*", library)) if p is None]
        raise FileNotFoundError(f"{' and '.join(missing)} not found under CUDA_HOME={cuda_home} or in the "
                                f"nvidia-* pip packages of {[str(d) for d in _site_dirs()]}")
    in_toolkit = header_dir.resolve() == (Path(cuda_home) / "include").resolve()
    include_dirs = [] if in_toolkit else [str(_private_include_dir(header_dir, scratch))]
    source_dir = HERE if source_dir is None else source_dir
    return BuildOptions(
        sources=[str(source_dir / name) for name in SOURCE_NAMES],
        include_dirs=include_dirs,
        cxx_flags=["-O3"],
        nvcc_flags=["-O3"] + nvcc_arch_flags(),
        ldflags=[str(library)],
    )
