"""Which implementation a kernel call runs: Triton, the plain-PyTorch reference, or torch SDPA.

"auto" (the default) runs Triton when the tensors are on CUDA and the reference otherwise.
Triton is imported only when a kernel runs: CPU installs need no Triton (CUDA builds of torch
bring it), and a CUDA machine without it runs the references.
`TPFLASH_KERNELS=auto|triton|reference` sets the process-wide choice (read once); `use_backend(name)`
overrides it inside a `with` block (tests force "triton" on CPU under TRITON_INTERPRET=1), for
every thread: autograd runs a CUDA backward on a thread of its own, which must see the same choice
(a context variable would not reach it).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Iterator, Optional

import torch

BACKENDS = ("auto", "triton", "reference")
_forced: Optional[str] = None  # use_backend's choice, process-wide


def _check(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}={name!r} must be one of {BACKENDS}")
    return name


@functools.lru_cache(maxsize=None)
def environment_backend() -> str:
    """$TPFLASH_KERNELS, else "auto": read once per process (every kernel call asks; a program that sets
    the variable after the first kernel call clears this cache: `environment_backend.cache_clear()`)."""
    return _check(os.environ.get("TPFLASH_KERNELS", "auto").strip().lower() or "auto", "TPFLASH_KERNELS")


def requested_backend() -> str:
    """The backend asked for: the innermost `use_backend`, else $TPFLASH_KERNELS, else "auto"."""
    return _forced if _forced is not None else environment_backend()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force `name` ("auto", "triton" or "reference") for the kernel calls made while the block runs, on
    any thread (the backward of a forward run inside it too, if run inside it)."""
    global _forced
    outer, _forced = _forced, _check(name, "backend")
    try:
        yield
    finally:
        _forced = outer


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether Triton can be imported here (asked once: a failed import is slow to repeat per kernel call)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pick(x: torch.Tensor) -> str:
    """"triton" or "reference" for a call on tensor `x`."""
    name = requested_backend()
    if name == "auto":
        return "triton" if x.is_cuda and triton_available() else "reference"
    if name == "triton" and not triton_available():
        raise ValueError("backend 'triton' was requested but Triton is not installed (CUDA builds of torch "
                         "bring it; for the CPU interpreter: pip install triton, or tpflash's [test] extra)")
    if name == "triton" and not x.is_cuda and not interpreting():
        raise ValueError("backend 'triton' was forced for a CPU tensor but TRITON_INTERPRET is not set "
                         "(Triton runs on CPU only in interpreter mode)")
    return name
