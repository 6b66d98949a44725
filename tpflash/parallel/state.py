"""Parallel state: the (dp, tp) device mesh and its process groups, built from the torchrun env.

`init(tp=2)` is the one place that creates process groups. It returns a `ParallelState` and
also records it as the *default* state, which layers consult when they are given no
`process_group`. That default is the only module-level state in tpflash; `set_default_state`
replaces or clears it (tests and programs that build two models with different groups use it,
or simply pass `process_group=` explicitly).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .agreement import check_ranks_agree
from .rendezvous import elastic_store


@dataclass
class ParallelState:
    """The layout of one job: world = dp * tp ranks, tp innermost (tp ranks are neighbours).

    Rank r has tp_rank = r % tp and dp_rank = r // tp, so a tp group never spans nodes when
    tp divides the GPUs per node.
    """

    mesh: DeviceMesh  # 2-D, dims ("dp", "tp")
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D sub-mesh over this rank's tp group (where the DTensor parameters live)."""
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D sub-mesh over this rank's dp group (what FSDP shards over)."""
        return self.mesh["dp"]

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """dp_size * tp_size: every process of the job."""
        return self.dp_size * self.tp_size

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}, dp={self.dp_rank}/{self.dp_size}, "
                f"tp={self.tp_rank}/{self.tp_size}, device={self.device})")


_default_state: Optional[ParallelState] = None


def get_default_state() -> Optional[ParallelState]:
    """The state made by the last `init` (or given to `set_default_state`), or None."""
    return _default_state


def set_default_state(state: Optional[ParallelState]) -> None:
    """Replace the default state that layers use when `process_group` is None."""
    global _default_state
    _default_state = state


def shutdown() -> None:
    """End the job's distributed state: destroy every process group, clear the default state, and free
    what referred to them now. Call it last, after dropping your own model (`del model`): on CPU, gloo
    groups and device meshes left for the interpreter's exit made about 1 in 10 two-rank runs abort
    with SIGABRT after finishing (torch 2.13)."""
    import gc
    if dist.is_initialized():
        dist.destroy_process_group()
    set_default_state(None)
    gc.collect()


def check_layout(world_size: int, tp: int, dp: int) -> int:
    """Validate (world, tp, dp) and return dp (resolving dp=-1). Raises ValueError naming the numbers."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an integer >= 1")
    if world_size % tp != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp={tp}")
    if dp == -1:
        return world_size // tp
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be -1 (infer) or an integer >= 1")
    if dp * tp != world_size:
        raise ValueError(f"dp={dp} * tp={tp} = {dp * tp} does not equal the world size {world_size}")
    return dp


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init(tp: int = 1, dp: int = -1, backend: Optional[str] = None, timeout_s: float = 600.0,
         agree: Optional[Dict[str, str]] = None) -> ParallelState:
    """Initialise torch.distributed from the torchrun environment and build the (dp, tp) mesh.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT through the env:// rendezvous, or
    torchrun's store with keys per restart attempt under `--max-restarts`: see rendezvous.py);
    with none set, runs as a single process (world 1) on a local rendezvous. The backend is
    nccl when CUDA is available, else gloo. The device is cuda:LOCAL_RANK or cpu.
    The layout is checked before any group is created, so bad input cannot hang. `agree`
    ({name: value} strings, e.g. the trainer's job fingerprint) is compared across the world once
    its process group exists and before the mesh is built: where ranks differ, every rank raises
    the same ValueError naming what differs (tpflash.parallel.agreement).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    dp = check_layout(world_size, tp, dp)
    if dist.is_initialized():  # follow the group the caller made (a gloo job on a GPU machine stays on CPU)
        use_cuda = "nccl" in str(dist.get_backend())
    else:
        use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda:
        local_rank = _env_int("LOCAL_RANK", 0)
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} "
                             "CUDA devices are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python script.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = elastic_store(timeout)  # under torchrun restarts: keys kept apart per attempt
        where = {} if store is None else dict(store=store, rank=int(os.environ["RANK"]),
                                              world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), timeout=timeout,
                                device_id=device if use_cuda else None, **where)
    if agree is not None:  # before the mesh: ranks asking for different (dp, tp) would build different meshes
        check_ranks_agree(agree)
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    state = ParallelState(
        mesh=mesh, tp_group=mesh["tp"].get_group(), dp_group=mesh["dp"].get_group(),
        tp_rank=mesh["tp"].get_local_rank(), tp_size=tp,
        dp_rank=mesh["dp"].get_local_rank(), dp_size=dp, device=device)
    set_default_state(state)
    return state


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoGroup:
    """The type of NO_GROUP."""

    def __repr__(self) -> str:
        return "tpflash.parallel.NO_GROUP"


NO_GROUP = _NoGroup()
"""Pass as `process_group=` to mean "no tensor parallelism" even while a default state exists
(None means "the default state's tp group")."""


def resolve_tp_group(process_group) -> Optional[dist.ProcessGroup]:
    """The group a layer works on: the one given, else the default state's tp group, else None (tp=1).
    NO_GROUP resolves to None whatever the default state."""
    if process_group is NO_GROUP:
        return None
    if process_group is not None:
        return process_group
    state = get_default_state()
    return state.tp_group if state is not None else None


def sublayer_group(group: Optional[dist.ProcessGroup]):
    """What a layer passes to the layers it builds for its resolved group: NO_GROUP for none, so that
    a tp=1 layer built under a default tp state does not get tp-sharded sublayers."""
    return NO_GROUP if group is None else group


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Ranks in `group` (1 for None). Asked on every layer call, so the group's own C++ method
    rather than dist.get_world_size's Python lookup."""
    return 1 if group is None else group.size()


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    """This process's rank within `group` (0 for None)."""
    return 0 if group is None else group.rank()
