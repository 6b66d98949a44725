"""One CUDA graph behind capture(fn) / replay(), its CPU stand-in, and the autocast states they run under.

GraphedBlocks (tpflash.layers.graphed_blocks) captures a stack's forward in one graph and its backward
in another, both in one memory pool; on CPU the stand-in reruns the captured function, so that the
plumbing around the replays runs in CI.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ..parallel import peer_collectives


# The backward is captured outside autocast, as the eager backward of PyTorch's AMP recipe runs (backward
# called outside autocast): its ops take the dtypes the forward saved, where under autocast an fp32 GEMM
# there would run in bf16; recomputation under activation checkpointing restores the forward's autocast.
NO_AUTOCAST: Tuple[bool, Optional[torch.dtype]] = (False, None)


def autocast_state(device_type: str) -> Tuple[bool, Optional[torch.dtype]]:
    """(enabled, dtype) of the autocast in force for device_type now."""
    if not torch.is_autocast_enabled(device_type):
        return False, None
    return True, torch.get_autocast_dtype(device_type)


def autocast_for(device_type: str, state: Tuple[bool, Optional[torch.dtype]]):
    """The autocast of `state`, without its weight-cast cache (a cached cast would outlive a replay)."""
    enabled, dtype = state
    if not enabled:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


class CudaGraph:
    """torch.cuda.CUDAGraph behind capture(fn) / replay(), sharing one memory pool per stack."""

    def __init__(self, pool):
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn: Callable[[], None]) -> None:
        # thread_local: the NCCL watchdog thread may query events while this thread captures
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            with peer_collectives.graph_epoch():  # copy-engine collectives: one barrier each, not two
                fn()

    def replay(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        # A graph that captured NCCL kernels holds a reference on their communicator until the graph
        # itself is destroyed, and destroying the process group waits for that reference forever
        # (pytorch/pytorch#115388): reset it now rather than whenever the last Python reference goes.
        self.graph.reset()


class EagerGraph:
    """CPU stand-in: replay() reruns the captured function under the autocast and grad mode of capture."""

    def __init__(self, device_type: str, autocast_state):
        self.device_type, self.autocast_state, self.fn = device_type, autocast_state, None

    def capture(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.replay()

    def replay(self) -> None:
        with torch.enable_grad(), autocast_for(self.device_type, self.autocast_state):
            self.fn()

    def release(self) -> None:
        self.fn = None
