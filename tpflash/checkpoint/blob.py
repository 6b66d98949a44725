"""Opaque values in a checkpoint: torch.save'd bytes, so DCP stores each as one item however it is nested.

Only torch and builtins are pickled, so `dcp_to_torch_save` output is readable without tpflash.
"""
from __future__ import annotations

import io

import torch


def to_blob(value: object) -> bytes:
    """A picklable value as bytes (torch.save), for storing non-tensor state inside a DCP checkpoint."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def from_blob(blob: bytes) -> object:
    """The value, with any tensors on CPU (a checkpoint saved on GPUs also resumes on a CPU machine)."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
