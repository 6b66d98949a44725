"""Sharded checkpoints over torch.distributed.checkpoint that reshard to any (dp, tp) on load.

    path = tpflash.checkpoint.save("ckpt", model, optimizer, step=100, scheduler=sched, tokens_seen=n)
    info = tpflash.checkpoint.load("ckpt", model, optimizer, scheduler=sched)  # {"step": 100, "tokens_seen": n}
    tpflash.checkpoint.latest("ckpt")                                            # ".../ckpt/step_100"
    model = tpflash.checkpoint.load_model("ckpt")  # built from its saved config, on this layout, eval mode

`python -m tpflash.checkpoint consolidate DIR OUT.safetensors [--hf-dir HFDIR]` writes one
unsharded file offline; `python -m tpflash.checkpoint export-hf DIR OUT_DIR` a Hugging Face model
directory, one tensor at a time (`tpflash.checkpoint.export_hf.export_hf`). See docs/checkpoints.md.
"""
from .api import load, reserve_staging, save, wait_pending
from .directory import latest
from .blob import UnsafeCheckpointError
from .integrity import CheckpointCorruptError
from .lock import CheckpointLockedError
from .model_loader import load_model
from .resume import CheckpointDirMismatchError, claim, resume_point
from .staging import HostStaging, PendingSave

__all__ = ["CheckpointCorruptError", "CheckpointDirMismatchError", "CheckpointLockedError", "HostStaging",
           "PendingSave", "UnsafeCheckpointError", "claim", "latest", "load", "load_model", "reserve_staging",
           "resume_point", "save", "wait_pending"]
