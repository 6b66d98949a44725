"""How much scratch memory cuBLAS's GEMMs get: none at tp > 1 (`gemm_workspace="auto"`).

With its default workspace, cuBLAS runs most forward and input-gradient GEMMs on Hopper with kernels
that schedule their tiles dynamically and need a counter zeroed before each call: a 4-byte memset
before every such GEMM, which in a CUDA graph is one more node in the stream's chain, with a gap on
either side of it. Without a workspace it picks statically scheduled variants of the same kernels,
no memset. At tp > 1 the blocks run each GEMM as one piece per rank's rows, and the gaps add up:
without a workspace gpt-2.7b's and llama-1b's tp=2 steps on two H200s ran 1.1-1.5% and 0.7-1.0%
faster (at tp=4, where the steps wait on the copy engines, the same within the launches' spread); at
tp=1 the differences stayed within the steps' spread from launch to launch, so "auto" leaves tp=1
alone (docs/performance.md, "The GEMMs' workspace").

The size comes from `CUBLAS_WORKSPACE_CONFIG` (":0:0": none), which torch reads once per process,
at its first cuBLAS call: `apply` must run before the process's first GEMM. A value the
environment already holds (e.g. ":4096:8" for deterministic algorithms) is the user's and is kept.
"""
from __future__ import annotations

import os
import warnings
from typing import MutableMapping, Optional

import torch

CHOICES = ("auto", "default", "none")
ENV = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"


def choose(setting: str, tp: int, environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """The CUBLAS_WORKSPACE_CONFIG value that `setting` asks for at tensor-parallel size `tp`, or None
    where the environment is left as it is: "default" (cuBLAS's own workspace), "none" (no workspace),
    "auto" (none at tp > 1). A value already in the environment is kept ("none" against another value
    raises), as is the default where torch's deterministic algorithms are on (they accept only the
    workspace sizes torch lists, ":4096:8" and ":16:8")."""
    if setting not in CHOICES:
        raise ValueError(f"gemm_workspace={setting!r} must be one of {CHOICES}")
    environ = os.environ if environ is None else environ
    held = environ.get(ENV)
    wants_none = setting == "none" or (setting == "auto" and tp > 1)
    if setting == "none" and held not in (None, NO_WORKSPACE):
        raise ValueError(f"gemm_workspace='none' conflicts with {ENV}={held!r} in the environment: unset it, "
                         "or use gemm_workspace=auto, which keeps it")
    if setting == "none" and torch.are_deterministic_algorithms_enabled():
        raise ValueError("gemm_workspace='none' is not possible with torch.use_deterministic_algorithms(True), "
                         f"which needs {ENV}=:4096:8 or :16:8; use gemm_workspace=auto or default")
    if not wants_none or held is not None or torch.are_deterministic_algorithms_enabled():
        return None
    return NO_WORKSPACE


def apply(setting: str, tp: int, on_cuda: Optional[bool] = None) -> Optional[str]:
    """Set CUBLAS_WORKSPACE_CONFIG for `setting` at tp (`choose`), before the process's first GEMM, where
    the process computes on CUDA (on_cuda, default: whether CUDA is available); elsewhere only check
    `setting`. Returns what the GEMMs get, for a log line ("none", "default" or the environment's
    value), or None off CUDA."""
    value = choose(setting, tp)
    if not (torch.cuda.is_available() if on_cuda is None else on_cuda):
        return None
    if value is not None:
        if torch.cuda.is_initialized():
            warnings.warn(f"gemm_workspace={setting!r}: CUDA was initialised before {ENV} was set; it takes effect "
                          "only if this process has run no GEMM yet", stacklevel=2)
        os.environ[ENV] = value
    held = os.environ.get(ENV)
    return "default" if held is None else "none" if held == NO_WORKSPACE else f"{ENV}={held}"
