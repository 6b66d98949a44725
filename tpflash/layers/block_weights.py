"""What a transformer block's layers take in place of their parameters during one forward of the block.

Two things are done once per block forward rather than once per layer (docs/architecture.md, "Layers
and data flow"):
  * the weights' casts to the compute dtype, one multi-tensor copy into one buffer
    (tpflash.layers.weight_casts.PendingCast) instead of about ten small cast kernels;
  * under tensor parallelism, the parameters whose gradient each rank holds a part of (the norms'
    weights and the row layers' biases under sequence parallelism, replicated k/v projections) go
    through one alias each (tpflash.parallel.comm.tp_grad_aliases), so that one all-reduce sums all
    their gradients at the end of the backward instead of one per norm and bias.

A block makes one `BlockWeights` and hands it to its layers when it is built, as it hands them its
`HeldWork` (tpflash.parallel.held_work). Its forward fills it for the call (`use`), or finds it
filled already by GraphedBlocks, which issues each block's casts in the previous block's waits and
sums the whole stack's partial gradients in one all-reduce. A layer used on its own keeps an empty
one of its own: it casts and sums as a plain layer does.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Sequence, Tuple

import torch

from ..parallel import comm
from .weight_casts import PendingCast


class BlockWeights:
    """The casts and tp-gradient aliases a block's layers use in the forward running now (module
    docstring); outside one, empty. `casts`: a PendingCast or None, passed to the GEMMs
    (weight_casts.stacked_cast); `summed_over_tp` gives the aliases."""

    def __init__(self):
        self.casts: Optional[PendingCast] = None
        self.aliases: Optional[Dict[int, torch.Tensor]] = None  # id(parameter) -> its alias

    @contextlib.contextmanager
    def use(self, casts: Optional[PendingCast], aliases: Optional[Dict[int, torch.Tensor]]) -> Iterator[None]:
        """Inside, the layers take these casts and aliases; a None leaves what is there (e.g. what an
        enclosing `use` gave). Afterwards, what was there before."""
        saved = self.casts, self.aliases
        self.casts = saved[0] if casts is None else casts
        self.aliases = saved[1] if aliases is None else aliases
        try:
            yield
        finally:
            self.casts, self.aliases = saved

    def summed_over_tp(self, params: Sequence[Optional[torch.Tensor]], group) -> Tuple[Optional[torch.Tensor], ...]:
        """params as the forward uses them where each rank's gradient is a part of the whole: each
        parameter's alias from `use` where there is one, the others through one
        comm.copy_to_tp_region_many (one all-reduce for them). None entries stay None. Process group:
        `group`."""
        aliases = self.aliases or {}
        out = [None if p is None else aliases.get(id(p)) for p in params]
        rest = [i for i, (p, alias) in enumerate(zip(params, out)) if p is not None and alias is None]
        for i, summed in zip(rest, comm.copy_to_tp_region_many([params[i] for i in rest], group)):
            out[i] = summed
        return tuple(out)
