"""The store a torchrun worker's default process group meets its peers on, kept apart per restart attempt.

torchrun's agent keeps one TCPStore for the whole job (TORCHELASTIC_USE_AGENT_STORE=True). After
`--max-restarts` restarts the workers, the new attempt's gloo/NCCL bootstrap can read the peer
addresses the *dead* attempt published under the same keys and fail with "Connection refused"
(pytorch/pytorch#167288 shows the NCCL form). Prefixing every key with the attempt number
(TORCHELASTIC_RESTART_COUNT) makes each attempt rendezvous only with itself.
"""
from __future__ import annotations

import datetime
import os
from typing import Optional

import torch.distributed as dist


def elastic_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """A per-attempt PrefixStore over torchrun's store, or None outside torchelastic (then env:// is used)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    return dist.PrefixStore(f"tpflash/attempt_{restart}", store)
