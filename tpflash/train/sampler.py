"""Which sample each dp rank reads at each step, defined by global sample index so resume is exact.

The order of samples is a seeded permutation per epoch: global sample g is sample
perm_e[g mod N] with e = g // N. A step consumes the next `batch_size` global indices
[c, c + batch_size); dp rank d takes the contiguous slice [c + d*B/dp, c + (d+1)*B/dp). The only
state is c, the number of samples consumed, so a job resumed with any dp (same global batch)
reads exactly the samples the original job would have read: none skipped, none repeated.
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np


class GlobalSampler:
    """Deterministic sample order over `num_samples` samples; `consumed` global samples done.

    Saved in checkpoints through state_dict()/load_state_dict().
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.consumed = 0
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._epoch = epoch
        return self._perm

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices of global positions [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        for k, g in enumerate(range(start, start + count)):
            out[k] = self._order(g // self.num_samples)[g % self.num_samples]
        return out

    def rank_slice(self, batch_size: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """This rank's sample indices of the next global batch (does not advance)."""
        if batch_size % dp_size != 0:
            raise ValueError(f"batch_size={batch_size} is not divisible by dp={dp_size}")
        per_rank = batch_size // dp_size
        return self.indices(self.consumed + dp_rank * per_rank, per_rank)

    def advance(self, batch_size: int) -> None:
        self.consumed += batch_size

    @property
    def epoch(self) -> float:
        return self.consumed / self.num_samples

    def state_dict(self) -> Dict[str, Any]:
        return {"consumed_samples": self.consumed, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue at the saved position. The data (num_samples) and seed must be unchanged."""
        saved_n, saved_seed = int(state["num_samples"]), int(state["seed"])
        if (saved_n, saved_seed) != (self.num_samples, self.seed):
            raise ValueError(f"checkpointed sampler had num_samples={saved_n}, seed={saved_seed} but this job has "
                             f"num_samples={self.num_samples}, seed={self.seed}: the data or seed changed")
        self.consumed = int(state["consumed_samples"])
