"""How long the trainer's checkpoint saves, loads and exports take, and at what rate: the records
it logs (kind "checkpoint" in metrics.jsonl, a `[checkpoint]` line on stdout).

A synchronous save is timed from the call to the commit (every file written, fsync'd, checksummed
and renamed into place): `save_s`. An asynchronous one blocks the training only while it copies
the state to host memory (`staged_s`); its background write is reported once it has committed
(`write_s`, at the next save or the end of the run). Loads (`load_s`, checksums verified) and Hugging
Face exports (`export_s`) are timed likewise, and so is `model.init_from`'s streaming load of a Hugging
Face model (`hf_load_s`, at step 0, `GB` the directory's weight files). Each record gives the bytes on disk (`GB`, 1e9) and
`GB_per_s`: compare it with the disk's own bandwidth. Save records also split rank 0's time into
its parts: `state_s` (building the state dict), `staging_s` (the copy to host memory: async saves, and synchronous ones that stage),
`dcp_write_s` (DCP: device-to-host copies, files written and fsync'd), `checksums_s`, `commit_s`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..checkpoint.directory import directory_bytes
from ..checkpoint.staging import PendingSave


def rate_record(key: str, seconds: float, path: str, nbytes: Optional[int] = None) -> Dict[str, float]:
    """{key: seconds, "GB": `nbytes` (default: the size of `path` now), "GB_per_s"}."""
    gb = (directory_bytes(path) if nbytes is None else nbytes) / 1e9
    return {key: round(seconds, 3), "GB": gb, "GB_per_s": gb / max(seconds, 1e-9)}


# checkpoint.save's parts (its `times`) as record keys
PART_KEYS = {"state": "state_s", "staging": "staging_s", "write": "dcp_write_s", "checksums": "checksums_s",
             "commit": "commit_s"}


def _parts(times: Dict[str, float], parts) -> Dict[str, float]:
    return {PART_KEYS[p]: round(times[p], 3) for p in parts if p in times}


class SaveTimes:
    """The records of the trainer's saves, including the background writes of async ones (which are
    reported once they have finished), with the parts of each (rank 0's: state dict, staging, DCP's
    write, checksums, commit). Only the rank that logs needs one."""

    def __init__(self):
        self.background: Optional[Tuple[int, str, Dict[str, float]]] = None  # an async save still being written

    def saved(self, step: int, path: str, seconds: float, times: Optional[Dict[str, float]] = None
              ) -> List[Tuple[int, Dict[str, float]]]:
        """[(step, record)] to log after the save of `step` returned `path` after `seconds` (`times`: the
        dict checkpoint.save filled): the earlier async save's write if it has finished since, then this save's."""
        times = {} if times is None else times
        records = self.finished()
        if isinstance(path, PendingSave):  # an async save: only staged so far
            records.append((step, {"staged_s": round(seconds, 3), **_parts(times, ("state", "staging"))}))
            self.background = (step, path, times)
        else:
            records.append((step, {**rate_record("save_s", seconds, path), **_parts(times, PART_KEYS)}))
        return records

    def finished(self) -> List[Tuple[int, Dict[str, float]]]:
        """[(step, record)] of the background write, if there was one and it has committed."""
        if self.background is None or not self.background[1].done() or self.background[1].seconds is None:
            return []
        step, pending, times = self.background
        self.background = None
        return [(step, {**rate_record("write_s", pending.seconds, pending, pending.bytes),
                        **_parts(times, ("write", "checksums", "commit"))})]
