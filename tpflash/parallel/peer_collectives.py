"""All-gather and reduce-scatter along dim 0 by copying through peers' memory (CUDA, NVLink).

NCCL's kernels move data with SMs, and on 2 H200s they reach about half the link bandwidth at the
16-20 MiB activations of sequence parallelism (docs/performance.md). Here every rank of the group
maps its peers' symmetric-memory buffers (torch.distributed._symmetric_memory) and the transfers
are plain `copy_`s between device pointers, which the copy engines carry without SMs:

  all_gather(x)       write x into every peer's buffer (at my slot); barrier; copy my buffer's slots
                      into the output; barrier
  reduce_scatter(x)   write x's chunk r into peer r's buffer (at my slot); barrier; sum my buffer's
                      world slots (one small SM kernel; fp32 accumulation for world > 2); barrier

Both push (a rank writes into its peers' memory): on 2 H200s an NVLink write of 21 MiB ran at 333
GiB/s, a read at 284. `PeerAllGather` and `PeerReduceScatter` are the same two collectives with
their parts exposed, so that GEMMs can consume or produce them one rank's part at a time while
the copy engines move the others on a side stream (tpflash.parallel.overlap). Above two ranks a
gather can also raise a flag per push in the receiver's signal pad (`by_piece`), so that a GEMM
waits for its peer's part alone. A GPU's copy engines move about 340-370 GB/s out of it in all,
whether its pushes go to one peer or to several at once (docs/overlap.md), so each collective's
pushes queue on one stream.

Synchronisation (device-side barriers over a two-buffer workspace per group, one barrier per
call inside a `graph_epoch`): tpflash.parallel.peer_workspace. Calls on a group must be issued in
the same order on every rank, which holds for the layers' collectives. Process group: the one
given (CUDA tensors, world > 1).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import socket
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..kernels.sum_parts import sum_parts
from .peer_workspace import _side_wait, _side_wait_back, _slot_bytes, _take_turn, _workspace, _Workspace
from .peer_workspace import graph_epoch, kept_buffer, reserve_next_part

__all__ = ["BACKENDS", "PeerAllGather", "PeerReduceScatter", "all_gather", "available", "can_map_peers",
           "capturing_for_graphs", "comm_backend", "for_graph_capture", "graph_epoch", "kept_buffer", "kept_part",
           "peer_access", "reachable", "reduce_scatter", "reduce_scatter_pieces", "reserve_gather_part", "side_stream",
           "start_reduce_scatter", "use_copy_engine"]

_ENV = "TPFLASH_COMM_BACKEND"
BACKENDS = ("auto", "nccl", "copy_engine")
_for_graphs = [False]  # inside for_graph_capture()
_peer_access: Dict[int, bool] = {}  # id(group) -> the group's agreed verdict


@functools.lru_cache(maxsize=None)
def comm_backend() -> str:
    """How the tp collectives move data (TPFLASH_COMM_BACKEND): "auto" (default): this module for the
    work CUDA graphs capture (`for_graph_capture`) and for transfers meant to travel beside a GEMM
    (`use_copy_engine`'s beside_compute) when every GPU of the group can map its peers' memory, where
    it measured faster than NCCL, and the group's own collectives elsewhere; "nccl":
    always the group's collectives (any backend); "copy_engine": this module for every CUDA group.
    Read once per process (every collective asks): `comm_backend.cache_clear()` re-reads it."""
    backend = os.environ.get(_ENV, "auto").strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"{_ENV}={backend!r} must be one of {BACKENDS}")
    return backend


def available(x: torch.Tensor, group) -> bool:
    """Whether this module can serve a collective on x over group: CUDA tensor, world > 1, and a torch
    with symmetric memory."""
    if group is None or not x.is_cuda or dist.get_world_size(group) == 1:
        return False
    return _has_symmetric_memory()


@functools.lru_cache(maxsize=None)
def _has_symmetric_memory() -> bool:  # once: layers ask at every call under overlap
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


def capturing_for_graphs() -> bool:
    """Whether the work issued now is inside `for_graph_capture` (a CUDA graph's warm-up or capture)."""
    return _for_graphs[0]


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


def use_copy_engine(x: torch.Tensor, group, beside_compute: bool = False) -> bool:
    """Whether an all-gather / reduce-scatter of x over group goes through this module now. beside_compute:
    the transfer is to travel beside the caller's next kernels (the fused loss's reduce-scatter beside
    its last GEMM), which "auto" then leaves the SMs to: an NCCL kernel there waits for the GEMM's SMs
    on one rank and slows the GEMM on another (docs/performance.md, "TP efficiency")."""
    backend = comm_backend()
    if backend == "nccl" or (backend == "auto" and not (_for_graphs[0] or beside_compute)):
        return False  # cheap answers first: every collective asks
    if backend == "copy_engine":
        return available(x, group)
    return reachable(x, group)


def reachable(x: torch.Tensor, group) -> bool:
    """Whether this module can serve x over group and every rank can map every other's memory
    (`peer_access`). Under CUDA graph capture only a verdict asked for before counts: the question
    is a collective (GraphedBlocks' warm-up asks it)."""
    if not available(x, group):
        return False
    if id(group) not in _peer_access and x.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return peer_access(group)


_streams: Dict[tuple, torch.cuda.Stream] = {}  # (device, use) -> a stream of the collectives' own


def _stream(device: torch.device, use: str) -> torch.cuda.Stream:
    if (device, use) not in _streams:
        _streams[(device, use)] = torch.cuda.Stream(device)
    return _streams[(device, use)]


def _signal_stream(device: torch.device) -> torch.cuda.Stream:
    return _stream(device, "signals")


class PeerAllGather:
    """An all-gather of x [n, ...] along dim 0 whose parts can be used as they arrive.

    Starts at construction, on `stream` (default: the current one): x is pushed into every peer's
    buffer (at this rank's slot), the previous rank first (it multiplies this rank's part first:
    `order`), and into `out`; a barrier waits for every rank's pushes, and the arrived parts are
    copied into out [world*n, ...]. `piece(r)` makes the current stream wait for rank r's part and
    returns it, [n, ...] (x itself for this rank; a peer's is a view of this rank's buffer, valid
    until `finish`): with by_piece and more than two ranks, for r's push alone (a signal r sends
    after it), so that the first peer's rows are multiplied while the others' travel; otherwise
    for the barrier. `finish()` waits for everything, ends with the barrier that frees the buffers
    (outside a graph_epoch), and returns out in rank order (None with keep=False: the parts are
    only used through `piece`, and nothing is copied out). With whole=True and keep=False, x is also
    copied into this rank's own slot beside the pushes, and `whole()` waits for every part and
    returns them as one [world*n, ...] tensor, a view of this rank's buffer (valid until `finish`),
    where the slots lie end to end (no padding; else None). With `kept` (a buffer of this call's
    own, peer_workspace.kept_buffer, of world * x's bytes) the parts are pushed there instead, x is
    copied into this rank's slot (unless it lies there already: `kept_part`), and `finish()` returns
    that buffer as the gathered [world*n, ...] tensor: kept for a backward without a copy out of the
    shared workspace, valid until any rank's next gather into the same buffer, whose pushes start at
    once: the caller sees that every rank has read it by then (in a model, the collectives between a
    layer's backward and its next forward).
    At most one other call on the group may be issued in between, and the parts must be used before
    it finishes (or, with `kept`, be read from the buffer).
    """

    def __init__(self, x: torch.Tensor, group, stream: Optional[torch.cuda.Stream] = None, keep: bool = True,
                 by_piece: bool = False, whole: bool = False, kept: Optional[_Workspace] = None):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.x = x.contiguous()
        self.slot = _slot_bytes(self.x.shape, self.x.dtype)
        self.kept = kept
        if kept is not None:
            self.slot = self.x.numel() * self.x.element_size()  # the parts end to end: one tensor
            if kept.nbytes != self.world * self.slot:
                raise ValueError(f"PeerAllGather: a kept buffer of {kept.nbytes} bytes for {self.world} parts of "
                                 f"{self.slot} bytes")
            keep = False
        self.ws = _workspace(group, x.device, 2 * self.world * _slot_bytes(self.x.shape, self.x.dtype))
        self.buffer, self.in_epoch = _take_turn(self.ws, self.x)  # the barrier and signal channels still take turns
        self.stream = stream or torch.cuda.current_stream()
        self.out = x.new_empty((self.world * x.shape[0],) + tuple(x.shape[1:])) if keep else None
        # a signal channel per buffer: a call's signals are all taken by its own piece/finish, before
        # the call two later (the same buffer, the same channel) sends again; channel 0 is the barrier's
        self.channel = 1 + self.buffer if by_piece and self.world > 2 else None
        parts = self.out.chunk(self.world) if keep else ()
        _side_wait(self.stream)
        with torch.cuda.stream(self.stream):
            for r in reversed(self.order()[1:]):  # pushes: NVLink writes ran faster than reads (docs/overlap.md)
                self._view(r, self.rank).copy_(self.x)
                if self.channel is not None:
                    self._signal(r)
            if keep:
                parts[self.rank].copy_(self.x)
            # the parts as one tensor in this rank's buffer, where the slots hold exactly one part each
            self.adjacent = kept is not None or (whole and not keep and self.slot == self.x.numel() * self.x.element_size())
            self.own_copied = None  # where x was copied into this rank's slot: when that is done
            own = self._view(self.rank, self.rank) if self.adjacent else None
            if own is not None and own.data_ptr() != self.x.data_ptr():  # x written there already: no copy
                own.copy_(self.x)
                self.own_copied = torch.cuda.Event()
                self.own_copied.record(self.stream)
            self.ws.barrier()  # every rank's part is here
            self.arrived = torch.cuda.Event()
            self.arrived.record(self.stream)
            for r in self.order()[1:] if keep else ():
                parts[r].copy_(self._view(self.rank, r))
        self._waited: set = set()  # peers whose part the current stream has waited for

    def _view(self, owner: int, slot: int, parts: int = 1) -> torch.Tensor:
        """owner's buffer from `slot`, `parts` slots long, as [parts * n, ...] (slots end to end if parts > 1)."""
        shape = (parts * self.x.shape[0],) + tuple(self.x.shape[1:])
        if self.kept is not None:
            return self.kept.view(owner, slot * self.slot, shape, self.x.dtype)
        return self.ws.view(owner, (self.buffer * self.world + slot) * self.slot, shape, self.x.dtype)

    def _signal(self, r: int) -> None:
        """Tell r its part has arrived, once the push queued last is done: from a stream of its own, so
        that the next push starts without waiting for the signal kernel's launch."""
        pushed = torch.cuda.Event()
        pushed.record(self.stream)
        signals = _signal_stream(self.x.device)
        signals.wait_event(pushed)
        with torch.cuda.stream(signals):
            self.ws.put_signal(r, self.channel)

    def order(self) -> List[int]:
        """The ranks in the order their parts are best consumed: this rank's first (no wait), then the next ranks."""
        return [(self.rank + step) % self.world for step in range(self.world)]

    def piece(self, r: int) -> torch.Tensor:
        if r == self.rank:
            return self.x
        self._wait_for(r)
        return self._view(self.rank, r)

    def _wait_for(self, r: int) -> None:
        if r in self._waited:
            return
        if self.channel is not None:
            self.ws.wait_signal(r, self.channel)  # on the current stream: r's part is in this rank's buffer
        elif not self._waited:
            torch.cuda.current_stream().wait_event(self.arrived)
        self._waited.add(r)

    def whole(self) -> Optional[torch.Tensor]:
        """Every rank's part in rank order, [world*n, ...], once all are here (the current stream waits);
        None unless asked for (whole=True, keep=False) and the slots hold no padding."""
        if not self.adjacent:
            return None
        for r in self.order()[1:]:
            self._wait_for(r)
        if self.own_copied is not None:
            torch.cuda.current_stream().wait_event(self.own_copied)
        return self._view(self.rank, 0, parts=self.world)

    def finish(self) -> Optional[torch.Tensor]:
        if self.channel is not None:  # take every signal of this call: the channel's next call sends again
            for r in self.order()[1:]:
                self._wait_for(r)
            _side_wait_back(_signal_stream(self.x.device))
        _side_wait_back(self.stream)
        if not self.in_epoch:
            self.ws.barrier()  # every rank has read its buffer: they may be written again
        return self.whole() if self.kept is not None else self.out


class PeerReduceScatter:
    """A reduce-scatter whose parts are sent as soon as they are computed.

    `send(r, part, row)` pushes this rank's partial sum of rank r's rows row.. row+len(part), part
    [k, ...], into rank r's buffer (at this rank's slot) on `stream` (default: the current one),
    while the caller computes the next part; `finish(own)` adds every rank's part for this rank's
    rows to own [m, ...] (fp32 accumulation above two ranks) and returns the sum, `finish_matmul(a,
    w)` the same for own = a @ w, `finish_parts(own)` the parts unsummed. Every peer gets all m
    rows, in one part or several.
    """

    def __init__(self, group, shape, dtype: torch.dtype, device: torch.device,
                 stream: Optional[torch.cuda.Stream] = None):
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shape, self.dtype = tuple(shape), dtype
        self.slot = _slot_bytes(self.shape, dtype)
        self.ws = _workspace(group, device, 2 * self.world * self.slot)
        self.buffer, self.in_epoch = _take_turn(self.ws)
        self.stream = stream or torch.cuda.current_stream()
        self.sent: List[torch.Tensor] = []  # alive until the pushes are done

    def _view(self, owner: int, slot: int) -> torch.Tensor:
        return self.ws.view(owner, (self.buffer * self.world + slot) * self.slot, self.shape, self.dtype)

    def send(self, r: int, part: torch.Tensor, row: int = 0) -> None:
        part = part.contiguous()
        _side_wait(self.stream)
        with torch.cuda.stream(self.stream):
            self._view(r, self.rank)[row:row + part.shape[0]].copy_(part)
        self.sent.append(part)

    def finish(self, own: torch.Tensor) -> torch.Tensor:
        received = self._arrived()
        if self.world == 2:
            return self._done(torch.add(own, received[0]))
        # in fp32, rounded once, by one kernel that reads every part once (torch's upcast copy, fp32
        # additions and downcast copy took 9 ms of a 104 ms gpt-2.7b step at tp=4: docs/performance.md,
        # "TP efficiency")
        return self._done(sum_parts([own, *received], self.dtype))

    def finish_parts(self, own: torch.Tensor) -> List[torch.Tensor]:
        """[own, *received]: the parts whose sum `finish(own)` returns, left for a consumer that adds them
        in a pass of its own (the next norm: kernels.layer_norm's parts). The received parts are views
        of this rank's buffer, valid until the call after next on the group, which writes it again
        only once every rank has passed the next call's barrier; so only inside a graph_epoch, whose
        calls end without the closing barrier, and only where nothing else writes into those views.
        Elsewhere [finish(own)]."""
        if not self.in_epoch:
            return [self.finish(own)]
        received = self._arrived()
        return [self._done(own), *received]

    def finish_matmul(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """finish(a @ w) for a [m, k], w [k, n]; at two ranks the GEMM adds the received part in its
        epilogue (one pass less, and one rounding), so it runs only once that part is here."""
        if self.world != 2:
            return self.finish(a @ w)
        return self._done(torch.addmm(self._arrived()[0], a, w))

    def _arrived(self) -> List[torch.Tensor]:
        """Waits for every rank's parts; the parts for this rank's rows, from its own buffer."""
        rows = sum(part.shape[0] for part in self.sent)
        if rows != (self.world - 1) * self.shape[0]:
            raise RuntimeError(f"PeerReduceScatter: {rows} rows sent, {(self.world - 1) * self.shape[0]} expected")
        _side_wait_back(self.stream)
        self.ws.barrier()  # every rank's parts have arrived
        return [self._view(self.rank, r) for r in range(self.world) if r != self.rank]

    def _done(self, out: torch.Tensor) -> torch.Tensor:
        if not self.in_epoch:
            self.ws.barrier()  # every rank has summed its slots: the buffers may be written again
        self.sent = []
        return out


def reserve_gather_part(group, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Where the next call on group, `PeerAllGather(x, group, whole=True, keep=False)` of an x [shape] of
    dtype, finds this rank's rows without copying them: this rank's slot of the buffer that call
    takes, as a [shape] tensor. A producer writes x there; the next call on the group must be that
    all-gather of it (RuntimeError otherwise, before it moves anything: peer_workspace.reserve_next_part)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    ws = _workspace(group, device, 2 * world * _slot_bytes(shape, dtype))
    return reserve_next_part(ws, world, rank, shape, dtype)


def kept_part(kept: _Workspace, group, shape, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part [shape] of dtype in a kept buffer (peer_workspace.kept_buffer), where
    PeerAllGather(x, group, kept=kept) puts x: a producer that writes x there spares the gather its
    copy of this rank's rows."""
    rank, nbytes = dist.get_rank(group), math.prod(shape) * dtype.itemsize
    return kept.view(rank, rank * nbytes, shape, dtype)


def reduce_scatter_pieces(fulls: Sequence[torch.Tensor], group, out_dtype: torch.dtype) -> torch.Tensor:
    """This rank's chunk of the sum over ranks of each full [world * n_i] (1-D; rank r's chunk at
    r * n_i), added in fp32 and rounded once to out_dtype: one flat [sum n_i] tensor, the chunks in
    order. The copy engines push every chunk into its owner's buffer (no SMs, and a bf16 chunk moves
    half the bytes of an fp32 one); one kernel then adds the world chunks (kernels.sum_parts). For
    sharded gradients in bf16 this computes what an fp32 reduce-scatter of them does, up to the
    order of the additions. Process group: `group` (CUDA tensors, world > 1)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if any(full.dim() != 1 or full.numel() % world for full in fulls):
        raise ValueError(f"reduce_scatter_pieces: every full must be 1-D with a multiple of {world} elements, got "
                         f"{[tuple(full.shape) for full in fulls]}")
    numels = [full.numel() // world for full in fulls]
    total, dtype = sum(numels), fulls[0].dtype
    slot = _slot_bytes((total,), dtype)
    ws = _workspace(group, fulls[0].device, 2 * world * slot)
    buffer, in_epoch = _take_turn(ws)

    def chunks_from(sender: int, owner: int) -> torch.Tensor:  # owner's buffer: what sender sent it
        return ws.view(owner, (buffer * world + sender) * slot, (total,), dtype)

    for step in range(world):  # the peers first, then this rank's own chunks
        owner, start = (rank + 1 + step) % world, 0
        into = chunks_from(rank, owner)
        for full, n in zip(fulls, numels):
            into[start:start + n].copy_(full[owner * n:(owner + 1) * n])
            start += n
    ws.barrier()  # every rank's chunks have arrived
    summed = sum_parts([chunks_from(sender, rank) for sender in range(world)], out_dtype)
    if not in_epoch:
        ws.barrier()  # every rank has read its buffer: it may be written again
    return summed


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x [n, ...] concatenated along dim 0 in rank order: [world*n, ...]."""
    return PeerAllGather(x, group).finish()


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of x [world*m, ...], keeping this rank's rows [m, ...] (rank order)."""
    return start_reduce_scatter(x, group, torch.cuda.current_stream(x.device))()


def start_reduce_scatter(x: torch.Tensor, group, stream: torch.cuda.Stream) -> Callable[[], torch.Tensor]:
    """reduce_scatter(x, group) with the pushes queued on `stream` now, once the current stream's work so
    far is done (x written), so that they travel beside the kernels the caller issues next; the
    returned function waits for every rank's parts (the current stream does) and returns the sum."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter: size {x.shape[0]} of dim 0 (shape {tuple(x.shape)}) "
                         f"is not divisible by the group size {world}")
    chunks = x.contiguous().chunk(world)  # chunk r: my partial sum of rank r's rows
    scatter = PeerReduceScatter(group, chunks[0].shape, x.dtype, x.device, stream)
    for step in range(1, world):
        r = (rank + step) % world
        scatter.send(r, chunks[r])
    return lambda: scatter.finish(chunks[rank])


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream on `device` that pushes meant to travel beside the caller's kernels are queued on (the
    overlapped layers' transfers, the fused loss's reduce-scatter): one per device, so they queue in
    issue order."""
    return _stream(device, "pushes")
