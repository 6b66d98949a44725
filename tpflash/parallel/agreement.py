"""Do all ranks agree on a set of named values? One all_gather, and the same error on every rank if not.

A job whose ranks were launched differently does not fail by itself: it hangs in the first
collective one rank calls and another does not, or computes silently wrong results. Checked once,
before such a collective, the difference becomes an error that every rank raises together,
naming what differs and on which ranks (`tpflash.parallel.init(agree=...)`).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.distributed as dist


def disagreements(fingerprints: List[Dict[str, str]], most: int = 3) -> List[str]:
    """Lines naming each key (at most `most`) whose value differs across ranks, with the ranks per value."""
    keys = list(dict.fromkeys(k for f in fingerprints for k in f))
    lines = []
    for key in keys:
        by_value: Dict[str, List[int]] = {}
        for rank, f in enumerate(fingerprints):
            by_value.setdefault(f.get(key, "<missing>"), []).append(rank)
        if len(by_value) > 1:
            lines.append(f"{key}: " + "; ".join(f"{v} on ranks {r}" for v, r in by_value.items()))
    return lines[:most] + ([f"... and {len(lines) - most} more"] if len(lines) > most else [])


def check_ranks_agree(fingerprint: Dict[str, str], group: Optional[dist.ProcessGroup] = None) -> None:
    """Gather every rank's fingerprint over `group` (default: the world) and raise ValueError on
    every rank, naming what differs, unless all are equal. Collective: all ranks call it once."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered: List[Optional[Dict[str, str]]] = [None] * world
    dist.all_gather_object(gathered, fingerprint, group=group)
    lines = disagreements(gathered)
    if lines:
        raise ValueError("the ranks of this job disagree, so its collectives would hang or compute different "
                         "things; launch every rank with the same arguments and data:\n  " + "\n  ".join(lines))
