"""Shared by the kernel tests: run a function on a backend, compare against a float64 reference."""
from __future__ import annotations

import os

import pytest
import torch

from tpflash.kernels import use_backend

# Triton on CPU needs the interpreter; without it the CPU twins of the GPU tests cannot run Triton.
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                       reason="Triton on CPU needs TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def assert_rel(actual, expected, dtype, name="", scale=1.0):
    """||actual - expected|| / ||expected|| <= TOL[dtype] * scale."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual.detach().float()).all(), f"{name}: non-finite values"
    err = rel_err(actual, expected)
    assert err <= TOL[dtype] * scale, f"{name}: relative error {err:.3g} > {TOL[dtype] * scale:g}"


def run_with_grads(fn, inputs, grads_out, backend="triton", grad_of=None):
    """(outputs, grads of the inputs at positions grad_of (default: every tensor)) of fn(*inputs) on
    `backend`, for upstream grads `grads_out`."""
    grad_of = range(len(inputs)) if grad_of is None else grad_of
    leaves = [t.detach().clone().requires_grad_(i in grad_of) if t is not None else None
              for i, t in enumerate(inputs)]
    with use_backend(backend):
        outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [t for t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad(outs, diff, [g.to(o.dtype) for o, g in zip(outs, grads_out)])
    return outs, grads


def float64_twin(fn, inputs, grads_out, grad_of=None):
    """(outputs, grads) of fn on float64 copies of the floating inputs: the ground truth."""
    twins = [t.double() if t is not None and t.is_floating_point() else t for t in inputs]
    return run_with_grads(fn, twins, [g.double() for g in grads_out], backend="reference", grad_of=grad_of)
