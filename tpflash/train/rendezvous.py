"""The default process group of a torchrun worker, with store keys kept apart per restart attempt.

torchrun's agent keeps one TCPStore for the whole job (TORCHELASTIC_USE_AGENT_STORE=True). After
`--max-restarts` restarts the workers, the new attempt's gloo/NCCL bootstrap can read the peer
addresses the *dead* attempt published under the same keys and fail with "Connection refused"
(pytorch/pytorch#167288 shows the NCCL form). Prefixing every key with the attempt number
(TORCHELASTIC_RESTART_COUNT) makes each attempt rendezvous only with itself.
`tpflash.parallel.init` then follows this group.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_default_group(timeout_s: float = 600.0) -> bool:
    """Create the default group on a per-attempt prefix store when running under torchelastic.

    Returns False (doing nothing) outside torchrun or when a default group already exists; then
    `tpflash.parallel.init` creates it the usual way.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or dist.is_initialized():
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    store = dist.PrefixStore(f"tpflash/attempt_{restart}", store)
    use_cuda = torch.cuda.is_available()
    device = None
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timeout, device_id=device)
    return True
