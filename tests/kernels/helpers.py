"""Shared by the kernel tests: run a function on a backend, compare against a float64 reference."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Dict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpflash.kernels import use_backend

# Triton on CPU needs the interpreter; without it the CPU twins of the GPU tests cannot run Triton.
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                       reason="Triton on CPU needs TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.float16: 5e-3, torch.bfloat16: 1e-2}


class ZeroFills(TorchDispatchMode):
    """Records the shapes of the zero tensors made while it is on (autograd makes one for each output
    of a Function whose gradient never came, unless the Function opts out)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.zero_.default):
            self.shapes.append(tuple(out.shape))
        return out


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


# Compiling for an H100 (sm_90 machine code, no GPU needed) catches what the interpreter lets through.
# Each kernel's test module registers a program that compiles its kernel and prints "compiled ..."; the
# programs run in one fresh process without TRITON_INTERPRET (where @triton.jit gives compilable
# kernels), at the first test that asks: importing torch and Triton there costs more than the compiles.
_H100_PROGRAMS: Dict[str, str] = {}

_RUN_PROGRAMS = """
import contextlib, io, json, sys, traceback
results = {}
for name, code in json.load(sys.stdin).items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"<{name}>", "exec"), {"__name__": "__main__"})
        results[name] = {"stdout": out.getvalue(), "error": None}
    except BaseException:  # noqa: BLE001 - each program's failure is its own test's
        results[name] = {"stdout": out.getvalue(), "error": traceback.format_exc()}
print(json.dumps(results))
"""


def h100_program(name: str, code: str) -> str:
    """Register `code` to be compiled for an H100 under `name` (at import of the kernel's test module)."""
    _H100_PROGRAMS[name] = code
    return name


@functools.lru_cache(maxsize=None)
def _h100_results() -> Dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", _RUN_PROGRAMS], input=json.dumps(_H100_PROGRAMS), env=env,
                          cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def compiled_for_h100(name: str) -> str:
    """What the program registered as `name` printed; fails with its traceback if it raised."""
    result = _h100_results()[name]
    assert result["error"] is None, result["error"][-3000:]
    return result["stdout"]
