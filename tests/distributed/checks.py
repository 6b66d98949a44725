"""Helpers shared by the distributed test bodies: devices, dtypes and tolerances."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import tpflash


def init_tp(tp: int, dp: int = -1):
    """The ParallelState for this test (also made the default for layers)."""
    return tpflash.parallel.init(tp=tp, dp=dp)


def init_layout(tp: int, cp: int, dp: int = -1):
    """The ParallelState with a cp dimension for this test (also made the default for layers)."""
    return tpflash.parallel.init(tp=tp, cp=cp, dp=dp)


def work_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (tight checks); bf16 on GPU (the dtype training uses; loose checks)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str = "", tol: float = None) -> None:
    """Relative error ||a - e|| / ||e|| against a tolerance chosen by dtype (METHOD.md's scale)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.isfinite(a).all():
        raise AssertionError(f"{name}: non-finite values")
    if tol is None:
        tol = 2e-2 if actual.dtype in (torch.bfloat16, torch.float16) else 1e-5
    err = ((a - e).norm() / e.norm().clamp_min(1e-12)).item()
    if err > tol:
        raise AssertionError(f"{name}: relative error {err:.3g} > {tol:g}")


def same_on_all_ranks(seed: int = 0) -> None:
    """Seed every rank identically, so that tp layers and their references draw the same weights."""
    torch.manual_seed(seed)


def broadcast_(t: torch.Tensor, group=None) -> torch.Tensor:
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return t


def reread_environment() -> None:
    """Forget the settings tpflash read from the environment once (TPFLASH_KERNELS, TPFLASH_COMM_BACKEND)."""
    from tpflash.kernels import dispatch
    from tpflash.parallel import peer_collectives
    dispatch.environment_backend.cache_clear()
    peer_collectives.comm_backend.cache_clear()


@contextlib.contextmanager
def environment(**settings):
    """This process's environment with `settings`, restored afterwards (rank processes are reused), and
    read afresh by tpflash on entry and exit."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    reread_environment()
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key)
            if value is not None:
                os.environ[key] = value
        reread_environment()
