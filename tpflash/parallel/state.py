"""Parallel state: the (dp, cp, tp) device mesh and its process groups, built from the torchrun env.

`init(tp=2, cp=2, dp=-1)` is the one place that creates process groups. It returns a `ParallelState` and
also records it as the *default* state, which layers consult when they are given no
`process_group`. That default is the only module-level state in tpflash; `set_default_state`
replaces or clears it (tests and programs that build two models with different groups use it,
or simply pass `process_group=` explicitly).
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .agreement import check_ranks_agree
from .rendezvous import elastic_store


@dataclass
class ParallelState:
    """The layout of one job: world = dp * cp * tp ranks, tp innermost (tp ranks are neighbours), then cp.

    Rank r has tp_rank = r % tp, cp_rank = (r // tp) % cp and dp_rank = r // (tp * cp), so a tp
    group never spans nodes when tp divides the GPUs per node. The cp ranks of one group share
    every sequence of their batch (tpflash.parallel.context_parallel) and hold the same parameters
    as their dp peers: FSDP and gradient averaging run over the dp * cp ranks (`dp_cp_mesh`).
    """

    mesh: DeviceMesh  # 3-D, dims ("dp", "cp", "tp"); with cp > 1 also the flattened "dp_cp"
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    cp_group: Optional[dist.ProcessGroup] = None  # defaults: a state without context parallelism
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The 1-D sub-mesh over this rank's tp group (where the DTensor parameters live)."""
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The 1-D sub-mesh over this rank's dp group (the ranks with the same tp and cp rank)."""
        return self.mesh["dp"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        """The 1-D sub-mesh over this rank's cp group (the ranks sharing each sequence)."""
        return self.mesh["cp"]

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """The 1-D mesh over the dp * cp ranks with this rank's tp rank, i.e. the ranks holding the same
        tp shard of every parameter: what FSDP shards over and DDP averages over. Its rank order is
        dp_rank * cp + cp_rank. At cp=1 it is `dp_mesh` itself."""
        return self.mesh["dp_cp"] if self.cp_size > 1 else self.dp_mesh

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The process group of `dp_cp_mesh` (`dp_group` at cp=1)."""
        return self.dp_cp_mesh.get_group() if self.cp_size > 1 else self.dp_group

    @property
    def dp_cp_size(self) -> int:
        """dp_size * cp_size: the ranks in `dp_cp_group`."""
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place in `dp_cp_group`: dp_rank * cp_size + cp_rank."""
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """dp_size * cp_size * tp_size: every process of the job."""
        return self.dp_size * self.cp_size * self.tp_size

    def __repr__(self) -> str:
        return (f"ParallelState(rank={self.rank}, dp={self.dp_rank}/{self.dp_size}, "
                f"cp={self.cp_rank}/{self.cp_size}, tp={self.tp_rank}/{self.tp_size}, device={self.device})")


_default_state: Optional[ParallelState] = None


def get_default_state() -> Optional[ParallelState]:
    """The state made by the last `init` (or given to `set_default_state`), or None."""
    return _default_state


def set_default_state(state: Optional[ParallelState]) -> None:
    """Replace the default state that layers use when `process_group` is None."""
    global _default_state
    _default_state = state


def shutdown(exit_after_s: Optional[float] = None, exit_status: int = 0, last_words: Optional[str] = None) -> None:
    """End the job's distributed state: destroy every process group, clear the default state, and free
    what referred to them now. Call it last, after dropping your own model (`del model`; a model with
    CUDA graphs: `release_cuda_graphs()` first, since a live graph that captured NCCL kernels makes the
    destruction wait forever): on CPU, gloo groups and device meshes left for the interpreter's exit
    made about 1 in 10 two-rank runs abort with SIGABRT after finishing (torch 2.13).

    `exit_after_s`: if destroying the groups has not returned after this many seconds, print one line
    and end the process with `exit_status` (for a launcher's worker, whose work is done or failed
    already: a hang here would hold the whole job). `last_words`: printed to stderr before that line
    (the error a failed run would have reported after this call, which such an exit skips)."""
    import gc
    import threading
    if exit_after_s is not None and not exit_after_s > 0:
        raise ValueError(f"exit_after_s={exit_after_s!r} must be a number of seconds > 0 "
                         "(or None: wait as long as it takes)")
    gc.collect()  # first what the caller dropped
    if dist.is_initialized():
        guard = None
        if exit_after_s is not None:
            guard = threading.Timer(exit_after_s, _exit_stuck, args=(exit_after_s, exit_status, last_words))
            guard.daemon = True
            guard.start()
        try:
            dist.destroy_process_group()
        finally:
            if guard is not None:
                guard.cancel()
    set_default_state(None)
    gc.collect()


def _exit_stuck(waited_s: float, status: int, last_words: Optional[str]) -> None:
    if last_words:
        print(last_words, file=sys.stderr, flush=True)
    rank = os.environ.get("RANK", "0")
    print(f"warning: rank {rank}: destroying the process groups did not finish within {waited_s:.0f} s; "
          f"exiting with status {status} without it", flush=True)
    os._exit(status)


def check_layout(world_size: int, tp: int, dp: int, cp: int = 1) -> int:
    """Validate (world, tp, dp, cp) and return dp (resolving dp=-1). Raises ValueError naming the numbers."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an integer >= 1")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be an integer >= 1")
    cp_text = f" * cp={cp} = {tp * cp}" if cp > 1 else ""
    if world_size % (tp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp={tp}{cp_text}")
    if dp == -1:
        return world_size // (tp * cp)
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} must be -1 (infer) or an integer >= 1")
    if dp * cp * tp != world_size:
        factors = f"dp={dp} * cp={cp} * tp={tp}" if cp > 1 else f"dp={dp} * tp={tp}"
        raise ValueError(f"{factors} = {dp * cp * tp} does not equal the world size {world_size}")
    return dp


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init(tp: int = 1, dp: int = -1, backend: Optional[str] = None, timeout_s: float = 600.0,
         agree: Optional[Dict[str, str]] = None, cp: int = 1) -> ParallelState:
    """Initialise torch.distributed from the torchrun environment and build the (dp, cp, tp) mesh.

    `init(tp=2, cp=2, dp=-1)`: tp ranks innermost, then cp, dp inferred from the world (see
    ParallelState for the rank formula). With cp > 1 the dp and cp dims are also flattened into
    the 1-D "dp_cp" mesh (ParallelState.dp_cp_mesh), once, here: flattening creates a group.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR/PORT through the env:// rendezvous, or
    torchrun's store with keys per restart attempt under `--max-restarts`: see rendezvous.py);
    with none set, runs as a single process (world 1) on an in-process store (no port). The backend is
    nccl when CUDA is available, else gloo. The device is cuda:LOCAL_RANK or cpu.
    Every group it creates times out after `timeout_s` (set_group_timeouts).
    The layout is checked before any group is created, so bad input cannot hang. `agree`
    ({name: value} strings, e.g. the trainer's job fingerprint) is compared across the world once
    its process group exists and before the mesh is built: where ranks differ, every rank raises
    the same ValueError naming what differs (tpflash.parallel.agreement).
    """
    world_size = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    dp = check_layout(world_size, tp, dp, cp)
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
    created_default = not dist.is_initialized()
    if created_default:
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" not in os.environ or ("MASTER_ADDR" not in os.environ and os.environ.get("WORLD_SIZE") == "1"):
            # plain `python script.py` (again, after an earlier world of one in this process): a world of one,
            # its store in this process (no TCP port to race for)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            store = dist.HashStore()
        else:
            store = elastic_store(timeout)  # under torchrun restarts: keys kept apart per attempt
        where = {} if store is None else dict(store=store, rank=int(os.environ["RANK"]),
                                              world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), timeout=timeout,
                                device_id=device if use_cuda else None, **where)
    if agree is not None:  # before the mesh: ranks asking for different (dp, cp, tp) would build different meshes
        check_ranks_agree(agree)
    mesh = init_device_mesh(device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    if cp > 1:  # a collective, so every rank makes it now rather than on first use; at cp=1 dp_mesh serves
        mesh["dp", "cp"]._flatten("dp_cp")
    # the mesh's groups would otherwise get torch's defaults (gloo 30 min, NCCL 10 min); a caller's own
    # default group keeps its timeout
    dims = ("dp", "cp", "tp") + (("dp_cp",) if cp > 1 else ())
    set_group_timeouts(timeout_s, [g for g in (mesh[d].get_group() for d in dims)
                                   if created_default or g is not dist.group.WORLD])
    state = ParallelState(
        mesh=mesh, tp_group=mesh["tp"].get_group(), dp_group=mesh["dp"].get_group(),
        tp_rank=mesh["tp"].get_local_rank(), tp_size=tp,
        dp_rank=mesh["dp"].get_local_rank(), dp_size=dp, device=device,
        cp_group=mesh["cp"].get_group(), cp_rank=mesh["cp"].get_local_rank(), cp_size=cp)
    set_default_state(state)
    return state


def set_group_timeouts(seconds: float, groups: Optional[Sequence[dist.ProcessGroup]] = None) -> None:
    """Give `groups` (default: every process group of this process, the default group and any made
    since) a timeout of `seconds` for their operations from now on. Groups made by `new_group` or a
    DeviceMesh do not inherit the default group's timeout, so `init` calls this once its groups exist."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in list(dist.distributed_c10d._world.pg_map) if groups is None else groups:
        group.set_timeout(timeout)


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


def resolve_cp_group(cp_group) -> Optional[dist.ProcessGroup]:
    """The context-parallel group a layer works on: the one given, else the default state's cp group
    when its cp > 1, else None (no context parallelism). NO_GROUP resolves to None."""
    if cp_group is NO_GROUP:
        return None
    if cp_group is not None:
        return cp_group
    state = get_default_state()
    return state.cp_group if state is not None and state.cp_size > 1 else None


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
