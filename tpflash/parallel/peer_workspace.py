"""The buffers and barriers behind tpflash.parallel.peer_collectives: one symmetric-memory workspace
per group and device, and which of its two buffers each call uses.

Synchronisation: device-side barriers (tiny kernels on the stream) over one workspace per group and
device that holds two buffers; successive calls alternate them, 0, 1, 0, ..., so that two calls
may be open at once (an all-gather of x still being read while a reduce-scatter is sent). A call
outside a `graph_epoch` pays two barriers: the first says every rank has written, the last that
every rank has finished reading, so whatever comes next may write either buffer. Inside a
`graph_epoch` (the body of a CUDA graph capture) a call pays only the first: a rank writes buffer
b at call k only after passing call k-1's barrier, which every peer reaches only after its reads
of call k-2, the last user of buffer b (each call's reads are queued before the next call's
barrier). The turns are fixed in the graph at capture, and the epoch ends with one more barrier
(the fence), after which either buffer is free as after an eager call: replays of such graphs and
eager calls then interleave in any order. Calls on a group must be issued in the same order on
every rank, which holds for the layers' collectives.
"""
from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch

_ALIGN = 512  # bytes; keeps every slot aligned for vectorised copies
_epochs: List["_Turns"] = []  # the graph_epoch open now, if any (a stack: epochs do not nest in practice)


class _Workspace:
    """One symmetric buffer of a group on one device, mapped by every rank of the group."""

    def __init__(self, group, device: torch.device, nbytes: int):
        from torch.distributed import _symmetric_memory as symm
        self.nbytes = nbytes
        self.reserved: Optional[int] = None  # data_ptr of the x the next call must gather (reserve_next_part)
        self.tensor = symm.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm.rendezvous(self.tensor, _group_name(group))  # collective: every rank at once

    def view(self, rank: int, offset_bytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """rank's buffer, from byte offset_bytes, as a [shape] tensor of dtype (a peer's: mapped memory)."""
        return self.handle.get_buffer(rank, tuple(shape), dtype, offset_bytes // dtype.itemsize)

    def barrier(self) -> None:
        """Every rank's stream reaches this point before any goes on (a kernel; capturable)."""
        self.handle.barrier(channel=0)

    def put_signal(self, rank: int, channel: int) -> None:
        """Raise this rank's flag on `channel` in rank's signal pad, once everything queued before it on
        the current stream is done (a kernel; it waits while the flag is still up from the last signal)."""
        self.handle.put_signal(rank, channel)

    def wait_signal(self, rank: int, channel: int) -> None:
        """The current stream goes on once rank's flag on `channel` is up here, and lowers it (a kernel)."""
        self.handle.wait_signal(rank, channel)


_enabled_groups: set = set()


def _group_name(group) -> str:
    """The group's name for symmetric memory, registering the group on first use (torch 2.11 needs
    `enable_symm_mem_for_group`; later versions deprecate it as unnecessary)."""
    name = group.group_name
    if name not in _enabled_groups:
        from torch.distributed import _symmetric_memory as symm
        enable = getattr(symm, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(name)
        _enabled_groups.add(name)
    return name


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


_kept: Dict[int, Dict[tuple, _Workspace]] = {}  # id(owner) -> (group, device, bytes) -> its buffer


def kept_buffer(owner: torch.Tensor, group, device: torch.device, nbytes: int) -> _Workspace:
    """A symmetric buffer of nbytes that belongs to `owner` (a layer's first weight) alone, mapped by
    every rank of group: where the layer's all-gathered input stays from its forward to its backward
    (PeerAllGather's `kept`), so that nothing is copied out of the shared workspace. Its contents
    live until the owner's next gather into it: one backward per forward, in order, as a CUDA graph
    of the blocks replays them. Created on first use, by every rank together (a rendezvous: never
    during graph capture), and dropped with the owner."""
    buffers = _kept.get(id(owner))
    if buffers is None:
        buffers = _kept[id(owner)] = {}
        weakref.finalize(owner, _kept.pop, id(owner), None)
    key = (id(group), device, nbytes)
    if key not in buffers:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a kept all-gather needs a new {nbytes}-byte buffer during CUDA graph capture: "
                               "run the captured work once eagerly first (GraphedBlocks' warm-up does)")
        buffers[key] = _Workspace(group, device, nbytes)
    return buffers[key]


def symmetric_bytes(device: Optional[torch.device] = None) -> int:
    """Bytes of symmetric memory this process holds for the copy-engine collectives, on `device` (default:
    every device): the workspaces (outgrown ones too, which stay mapped) and the kept buffers. The
    caching allocator does not see them, so torch.cuda.max_memory_allocated leaves them out."""
    buffers = list(_workspaces.values()) + _retired + [ws for owned in _kept.values() for ws in owned.values()]
    return sum(ws.nbytes for ws in buffers if device is None or ws.tensor.device == device)


def _slot_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of one rank's slot for a [shape] tensor of dtype, rounded up to the alignment."""
    return -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN


def _side_wait(stream: torch.cuda.Stream) -> None:
    """`stream` starts after the work queued so far on the current stream (nothing to do if it is that stream)."""
    if stream != torch.cuda.current_stream():
        stream.wait_stream(torch.cuda.current_stream())


def _side_wait_back(stream: torch.cuda.Stream) -> None:
    """The current stream continues after everything queued on `stream`."""
    if stream != torch.cuda.current_stream():
        torch.cuda.current_stream().wait_stream(stream)


class _Turns:
    """Which of its two buffers each call on a workspace uses: 0, 1, 0, ... in call order."""

    def __init__(self):
        self.calls: Dict[int, Tuple["_Workspace", int]] = {}  # id(workspace) -> (it, calls so far), first use first

    def take(self, ws: "_Workspace") -> int:
        """The buffer the next call on ws uses."""
        buffer = self.peek(ws)
        self.calls[id(ws)] = (ws, self.calls.get(id(ws), (ws, 0))[1] + 1)
        return buffer

    def peek(self, ws: "_Workspace") -> int:
        """The buffer the next call on ws will use, the call not yet counted."""
        return self.calls.get(id(ws), (ws, 0))[1] % 2

    def used(self) -> List["_Workspace"]:
        """The workspaces called on, first use first."""
        return [ws for ws, _ in self.calls.values()]


_eager_turns = _Turns()  # calls outside any graph_epoch: two barriers each, so any buffer is free after


@contextlib.contextmanager
def graph_epoch():
    """Marks the body of a CUDA graph capture: the calls inside pay one barrier each instead of two
    (module docstring), and one more barrier per workspace used (the fence) ends the epoch. Every
    rank of a group must run the same calls inside it."""
    epoch = _Turns()
    _epochs.append(epoch)
    try:
        yield
    finally:
        _epochs.pop()
    for ws in epoch.used():  # first use first: the same order on every rank of its group
        ws.barrier()


def _take_turn(ws: "_Workspace", x: Optional[torch.Tensor] = None) -> Tuple[int, bool]:
    """(the buffer a call on ws uses, whether its closing barrier is left out: inside a graph_epoch).
    x: what an all-gather sends; where a producer wrote into the slot reserved for the next call
    (`reserve_next_part`), that call must be the all-gather of what it wrote (RuntimeError otherwise:
    another call would take the buffer the producer's output lies in)."""
    reserved, ws.reserved = ws.reserved, None
    if reserved is not None and (x is None or x.data_ptr() != reserved):
        raise RuntimeError("a producer wrote its output into this rank's slot for the next all-gather on this "
                           "group (peer_workspace.reserve_next_part), but the next call on the group is another "
                           "collective: the calls between a row layer's output gradient and its backward changed")
    turns = _epochs[-1] if _epochs else _eager_turns
    return turns.take(ws), bool(_epochs)


def reserve_next_part(ws: "_Workspace", world: int, rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """This rank's slot [shape] of dtype in the buffer the next call on ws takes, for an all-gather of a
    [shape] dtype tensor (peer_collectives.PeerAllGather's layout): a producer that writes that
    tensor there (a norm's backward writing a row layer's output gradient) spares the gather its copy
    of this rank's rows. Reserved: the next call on ws must gather exactly that tensor (`_take_turn`).
    The slot is free to write once the work queued so far on this rank's streams is done: inside a
    graph_epoch its last user was the call two before, whose reads of this rank's slot are this
    rank's own (peers write only their slots), queued before; outside, every call frees its buffers."""
    slot = _slot_bytes(shape, dtype)
    buffer = (_epochs[-1] if _epochs else _eager_turns).peek(ws)
    part = ws.view(rank, (buffer * world + rank) * slot, shape, dtype)
    ws.reserved = part.data_ptr()
    return part
