"""All-gather and reduce-scatter along dim 0 by copying through peers' memory (CUDA, NVLink).

NCCL's kernels move data with SMs, and on 2 H200s they reach about half the link bandwidth at the
16-20 MiB activations of sequence parallelism (docs/performance.md). Here every rank of the group
maps its peers' symmetric-memory buffers (torch.distributed._symmetric_memory) and the transfers
are plain `copy_`s between device pointers, which the copy engines carry without SMs:

  all_gather(x)       write x into my buffer; barrier; copy every peer's buffer into the output; barrier
  reduce_scatter(x)   write x's chunk r into peer r's buffer (at my slot); barrier; sum my buffer's
                      world slots (one small SM kernel; fp32 accumulation for world > 2); barrier

Synchronisation: one buffer per group and device, and two device-side barriers per call (tiny
kernels on the current stream): the first says every rank has written, the last that every rank
has finished reading, so the next call may write again. No state lives on the host between calls,
which is what lets a CUDA graph capture these calls and replay them in any interleaving with eager
ones (an earlier version alternated two buffers with one barrier per call; the alternation was host
state that a replay would not advance). Calls on a group must be issued in the same order on every
rank, on one stream, which holds for the layers' collectives. Process group: the one given (CUDA
tensors, world > 1).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

_ENV = "TPFLASH_COMM_BACKEND"
BACKENDS = ("auto", "nccl", "copy_engine")
_ALIGN = 512  # bytes; keeps every slot aligned for vectorised copies
_for_graphs = [False]  # inside for_graph_capture()
_peer_access: Dict[int, bool] = {}  # id(group) -> the group's agreed verdict


def comm_backend() -> str:
    """How the tp collectives move data (TPFLASH_COMM_BACKEND): "auto" (default): this module for the
    work CUDA graphs capture (`for_graph_capture`) when every GPU of the group can map its peers'
    memory, where it measured faster than NCCL, and the group's own collectives elsewhere; "nccl":
    always the group's collectives (any backend); "copy_engine": this module for every CUDA group."""
    backend = os.environ.get(_ENV, "auto").strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"{_ENV}={backend!r} must be one of {BACKENDS}")
    return backend


def available(x: torch.Tensor, group) -> bool:
    """Whether this module can serve a collective on x over group: CUDA tensor, world > 1, and a torch
    with symmetric memory."""
    if group is None or not x.is_cuda or dist.get_world_size(group) == 1:
        return False
    return importlib.util.find_spec("torch.distributed._symmetric_memory") is not None


@contextlib.contextmanager
def for_graph_capture():
    """Marks work that a CUDA graph will capture (GraphedBlocks' warm-up and capture): the "auto"
    backend sends its collectives through the copy engines (peer access permitting)."""
    saved, _for_graphs[0] = _for_graphs[0], True
    try:
        yield
    finally:
        _for_graphs[0] = saved


def peer_access(group) -> bool:
    """Whether every rank of `group` runs on its own GPU of one host and can map every other's memory
    (torch.cuda.can_device_access_peer), as all ranks agree. A collective on the first call per
    group (cached): every rank must ask, in the same order, outside graph capture."""
    key = id(group)
    if key not in _peer_access:
        me = torch.cuda.current_device()
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, (socket.gethostname(), me), group=group)
        ok = can_map_peers(ranks, me, torch.cuda.can_device_access_peer)
        verdict = torch.tensor([int(ok)], device=torch.device("cuda", me))
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        _peer_access[key] = bool(verdict.item())
    return _peer_access[key]


def can_map_peers(ranks: Sequence[Tuple[str, int]], me: int, can_access: Callable[[int, int], bool]) -> bool:
    """This rank's view, from every rank's (host, CUDA device index): one host, a distinct device per rank
    (two ranks reporting one index, e.g. each limited by CUDA_VISIBLE_DEVICES, cannot be checked), and
    peer access from device `me` to every other."""
    return (len(set(ranks)) == len(ranks) and len({host for host, _ in ranks}) == 1
            and all(d == me or can_access(me, d) for _, d in ranks))


def use_copy_engine(x: torch.Tensor, group) -> bool:
    """Whether an all-gather / reduce-scatter of x over group goes through this module now."""
    backend = comm_backend()
    if backend == "nccl" or (backend == "auto" and not _for_graphs[0]):  # cheap answers first: every collective asks
        return False
    if not available(x, group):
        return False
    if backend == "copy_engine":
        return True
    if id(group) not in _peer_access and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False  # cannot ask the group now; NCCL is captured as well (the warm-up asks first)
    return peer_access(group)


class _Workspace:
    """One symmetric buffer of a group on one device, mapped by every rank of the group."""

    def __init__(self, group, device: torch.device, nbytes: int):
        from torch.distributed import _symmetric_memory as symm
        from .symm_overlap import _group_name
        self.nbytes = nbytes
        self.tensor = symm.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm.rendezvous(self.tensor, _group_name(group))  # collective: every rank at once

    def view(self, rank: int, offset_bytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """rank's buffer, from byte offset_bytes, as a [shape] tensor of dtype (a peer's: mapped memory)."""
        return self.handle.get_buffer(rank, tuple(shape), dtype, offset_bytes // dtype.itemsize)

    def barrier(self) -> None:
        """Every rank's stream reaches this point before any goes on (a kernel; capturable)."""
        self.handle.barrier(channel=0)


_workspaces: Dict[tuple, _Workspace] = {}
_retired: List[_Workspace] = []  # outgrown buffers stay mapped: work already queued may still use them


def _workspace(group, device: torch.device, nbytes: int) -> _Workspace:
    key = (id(group), device)
    ws = _workspaces.get(key)
    if ws is None or ws.nbytes < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"copy-engine collectives need a {nbytes}-byte buffer during CUDA graph capture, "
                               f"but only {ws.nbytes if ws else 0} bytes were set up before it: run the "
                               "captured work once eagerly first (GraphedBlocks' warm-up does)")
        # every rank asks for the same sizes in the same order, so all grow here together
        if ws is not None:
            _retired.append(ws)
        size = max(nbytes, 2 * (ws.nbytes if ws else 0))
        ws = _workspaces[key] = _Workspace(group, device, -(-size // _ALIGN) * _ALIGN)
    return ws


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x [n, ...] concatenated along dim 0 in rank order: [world*n, ...]."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    ws = _workspace(group, x.device, x.numel() * x.element_size())
    ws.view(rank, 0, x.shape, x.dtype).copy_(x)
    ws.barrier()  # every rank's part is written
    out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
    parts = out.chunk(world)
    for step in range(world):  # start with the next rank so that peers do not all read one buffer
        r = (rank + step) % world
        parts[r].copy_(x if r == rank else ws.view(r, 0, x.shape, x.dtype))
    ws.barrier()  # every rank has read: the buffers may be written again
    return out


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of x [world*m, ...], keeping this rank's rows [m, ...] (rank order)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter: size {x.shape[0]} of dim 0 (shape {tuple(x.shape)}) "
                         f"is not divisible by the group size {world}")
    x = x.contiguous()
    chunks = x.chunk(world)  # chunk r: my partial sum of rank r's rows
    chunk_bytes = chunks[0].numel() * x.element_size()
    stride = -(-chunk_bytes // _ALIGN) * _ALIGN
    ws = _workspace(group, x.device, world * stride)
    for step in range(1, world):  # push into peer r's buffer, at my position
        r = (rank + step) % world
        ws.view(r, rank * stride, chunks[r].shape, x.dtype).copy_(chunks[r])
    ws.barrier()  # every rank's chunks have arrived
    received = [ws.view(rank, r * stride, chunks[r].shape, x.dtype) for r in range(world) if r != rank]
    if world == 2:
        out = torch.add(chunks[rank], received[0])
    else:
        total = chunks[rank].float()
        for part in received:
            total += part
        out = total.to(x.dtype)
    ws.barrier()  # every rank has summed its slots: the buffers may be written again
    return out
