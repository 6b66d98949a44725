"""Opaque values in a checkpoint: torch.save'd bytes, so DCP stores each as one item however it is nested.

Only torch and builtins (plus NumPy arrays and scalars, as NumPy's RNG state holds) are pickled,
so `dcp_to_torch_save` output is readable without tpflash. Loading unpickles with
`weights_only=True` and an allow-list of exactly those NumPy types: a crafted checkpoint whose
extras hold any other object (a callable reduced to `os.system`, a class of some module) is
refused with `UnsafeCheckpointError` before anything in it runs.
"""
from __future__ import annotations

import io
import pickle
import re
from typing import List

import torch

from .integrity import CheckpointCorruptError


class UnsafeCheckpointError(CheckpointCorruptError):
    """A checkpoint entry holds a pickled object outside the types tpflash stores (refused unloaded)."""


def _numpy_globals() -> List[object]:
    """The NumPy pickling helpers needed for arrays, dtypes and scalars (NumPy's RNG state)."""
    try:
        import numpy as np
    except ImportError:  # without NumPy no checkpoint of ours holds NumPy values
        return []
    try:
        from numpy._core import multiarray  # NumPy 2
    except ImportError:
        from numpy.core import multiarray  # NumPy 1
    dtypes = {type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDGSUV"}
    return [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar, *sorted(dtypes, key=str)]


# TorchVersion (a str subclass): the torch version of checkpoints written before it was stored as a str
SAFE_GLOBALS = [torch.torch_version.TorchVersion, *_numpy_globals()]


def to_blob(value: object) -> bytes:
    """A picklable value as bytes (torch.save), for storing non-tensor state inside a DCP checkpoint."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def from_blob(blob: bytes, where: str = "a checkpoint entry") -> object:
    """The value, with any tensors on CPU (a checkpoint saved on GPUs also resumes on a CPU machine).

    Only builtins, tensors and NumPy arrays/scalars are accepted (`weights_only=True`); anything else
    raises UnsafeCheckpointError naming `where`, without running the pickled object.
    """
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:global|GLOBAL) (?:GLOBAL )?([\w.]+)", str(e))
        what = found.group(1) if found else "object outside the allow-list"
        raise UnsafeCheckpointError(
            f"{where} holds a pickled {what}, which tpflash never stores; it was refused unloaded. "
            "Checkpoints hold only tensors, builtins and NumPy values; load this one only if you trust it, "
            "with torch.load(..., weights_only=False)") from None
