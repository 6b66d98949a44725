"""Sharded checkpoints over torch.distributed.checkpoint that reshard to any (dp, tp) on load.

    path = tpflash.checkpoint.save("ckpt", model, optimizer, step=100, scheduler=sched, tokens_seen=n)
    info = tpflash.checkpoint.load("ckpt", model, optimizer, scheduler=sched)  # {"step": 100, "tokens_seen": n}
    tpflash.checkpoint.latest("ckpt")                                            # ".../ckpt/step_100"

`python -m tpflash.checkpoint consolidate DIR OUT.safetensors [--hf-dir HFDIR]` writes one
unsharded file offline. See docs/checkpoints.md.
"""
from .api import load, save, wait_pending
from .directory import latest
from .integrity import CheckpointCorruptError
from .staging import PendingSave

__all__ = ["CheckpointCorruptError", "PendingSave", "latest", "load", "save", "wait_pending"]
