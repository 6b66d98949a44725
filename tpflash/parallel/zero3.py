"""fsdp=zero3: the transformer blocks' parameters sharded over dp, gathered into two static buffers the
blocks take turns with, so that CUDA-graphed blocks replay on fixed addresses.

FSDP2 gives every all-gather a fresh allocation and runs Python hooks around every block, so its
blocks cannot be captured and its step is host-bound (docs/performance.md, "Sharded data
parallelism"). All blocks of a model have the same parameter shapes, which allows another layout:

- masters: each block parameter's rows are split over the dp (x cp) ranks like FSDP2's (torch.chunk
  along dim 0; a DTensor with Shard(0) on `ps.dp_cp_mesh`, so the optimizer, the gradient norm and
  checkpoints treat the model exactly as under FSDP2), held in one flat fp32 buffer per block, and
  their gradients in a second;
- compute: two buffers ("slots") of one block's unsharded parameters in the compute dtype; block i
  uses slot i % 2. Each block parameter has a leaf tensor that views its place in its block's slot,
  and while the block runs its modules hold those leaves in place of the masters. Before block i
  runs forward, its shards are all-gathered into its slot (one grouped all-gather per block; block
  i + 1's while block i computes);
  in the backward, block i's slot is gathered again before its backward (the last two blocks still
  hold theirs), while block i + 1's backward computes;
- gradients: a hook on each leaf copies its gradient into a reduction slot; when a block's last one
  is in, this rank's rows of their sum over dp, divided by dp, are added to the block's gradient
  buffer (micro-batches accumulate until `new_step`), while the blocks before it compute theirs. The
  sum is an fp32 reduce-scatter of fp32 slots (one grouped collective, one launch), except where
  the comm backend sends the work to the copy engines (by default: the graphed blocks' warm-up and
  capture; tpflash.parallel.peer_collectives) and the gathered weights are narrower than the
  masters: then the slots hold the gradients in the compute dtype, the copy engines push each
  rank's rows to it, and one kernel adds them in fp32 (`reduce_scatter_pieces`): the sum an fp32
  reduce-scatter of the bf16 gradients gives, with half the bytes on the links, no SMs moving them
  and no fp32 copy of the gradients. Decided once per backward (`_reduces_through_peers`);
- the "resident" parameters are sharded too, but gathered for all blocks at once at the start of the
  forward, kept until the next one (they are small), and reduced after the backward: the blocks'
  tp-partial-gradient ones (norm weights under sequence parallelism: summed over tp in autograd at
  the end of the stack's backward), and every 1-D one (norms, biases) where the blocks' backward
  reads no weight (`Block.backward_reads_weights`: fp8 tensorwise GEMMs, whose backward multiplies
  the fp8 copies its forward saved). The backward then gathers nothing: half the all-gathers;
- fp8 gathers: where, besides, the blocks' GEMMs cast whole weights with one tensorwise scale per
  group they stack (`Block.fp8_weight_groups`: q/k/v, o, up/gate, down), the main slots are gathered
  in fp8 instead: each rank casts its rows of a block (through the compute dtype, so the bits are
  those of casting the gathered weights) with its group's scale, the groups' amaxes maxed over the
  ranks first (one small all-reduce per block), and the e4m3 bytes are gathered, half of the compute
  dtype's. Each leaf carries its fp8 copy and scale (`kernels.fp8.Fp8Weight`), which the GEMMs multiply
  instead of casting the leaf; the leaves' own slots hold no memory (one element seen everywhere:
  their gradients still flow).

Everything outside the blocks (embeddings, final norm, head) is left to FSDP2 on the model's root
unit (`shard_blocks`): those run eagerly anyway. Communication per step is FSDP's (an all-gather in
the forward, in fp8 under fp8 gathers, and, unless the blocks' backward reads no weight, in the
backward; a reduce-scatter);
memory per rank is the sharded fp32 weights, gradients and AdamW state (16 / dp bytes per
parameter) plus the two compute slots and two reduction slots of one block (`bytes_per_rank`; a
reduction slot is made on the first backward that uses it, in fp32 or in the compute dtype).

On CUDA the collectives run on a side stream, ordered against the compute by events recorded in the
same forward or backward; on CPU they run inline. Capture (tpflash.layers.graphed_blocks) records
the same schedule: every decision (which slot holds which block, what to gather) is the same at
every step, because every forward gathers every block again (the weights changed).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..kernels.fp8 import E4M3, Fp8Weight, cast
from . import peer_collectives
from .comm import all_gather_many, reduce_scatter_many
from .state import ParallelState
from .zero3_layout import Piece, block_parameters, layout, module_and_name

_EVERY_PARAMETER_USED = ("fsdp=zero3 needs every block parameter used in the forward (a block's gradients are reduced "
                         "once all of them have arrived)")
KINDS = ("main", "resident")  # double-buffered per block / gathered for all blocks at once (module docstring)


class ShardedBlocks:
    """ZeRO-3 for `model.blocks` over `ps.dp_cp_group` (module docstring).

    Construct it on every rank once the blocks' weights are final and alike on every dp rank, before
    the optimizer (which then steps the sharded masters) and before any CUDA-graph capture; or on
    blocks still on the meta device, whose masters then start at zero for a loader or a checkpoint to
    fill in place (nothing is held whole: `model.init_from` under fsdp=zero3). Buffers live on
    `ps.device`.
    `compute_dtype`: the dtype of the gathered weights (bf16 under autocast on CUDA; default the
    parameters' own). Per step: forward and backward (the hooks gather and reduce),
    `wait_for_gradients()`, the optimizer step on the masters, `optimizer.zero_grad(set_to_none=True)`,
    then `new_step()` (micro-batches accumulate until then, graphed or not). Collectives over the
    dp * cp group, inside the blocks' forward and backward.
    """

    def __init__(self, model: nn.Module, ps: ParallelState, compute_dtype: Optional[torch.dtype] = None,
                 fp8_gathers: bool = True):
        self.group, self.ranks, self.rank = ps.dp_cp_group, ps.dp_cp_size, ps.dp_cp_rank
        self.blocks = list(getattr(model, "blocks", []))
        named, is_partial = block_parameters(self.blocks)
        # whether the backward gathers each block's weights again (module docstring), as its blocks say
        self.regather = any(getattr(b, "backward_reads_weights", lambda: True)() for b in self.blocks)
        resident = [part or (not self.regather and p.dim() == 1) for (_, p), part in zip(named[0], is_partial)]
        master_dtype, device = named[0][0][1].dtype, ps.device
        self.master_dtype, self.device = master_dtype, device
        self.compute_dtype = compute_dtype or master_dtype
        self.cuda = device.type == "cuda"
        self.pieces: Dict[str, List[Piece]] = {}
        sizes = {}  # kind -> (shard elements, slot elements)
        for kind, wanted in zip(KINDS, (False, True)):
            self.pieces[kind], *sizes[kind] = layout([x for x, res in zip(named[0], resident) if res == wanted],
                                                     self.ranks)
        # per main piece, the fp8 group its GEMM casts it in (module docstring), or None: gathered as it is
        self.fp8_group = self._fp8_groups(named[0]) if fp8_gathers and not self.regather else None
        self._allocate(len(self.blocks), sizes, master_dtype, device)
        self.leaves: List[Dict[str, torch.Tensor]] = []  # per block: path -> the leaf viewing its slot
        self.masters: List[Dict[str, nn.Parameter]] = []  # per block: path -> the DTensor master
        self._places: List[List[Tuple[nn.Module, str, torch.Tensor, nn.Parameter]]] = []  # per block, for _swap
        self._grad_views: List[Tuple[nn.Parameter, torch.Tensor]] = []  # (master, its DTensor gradient)
        for i, params in enumerate(named):
            self._bind_block(i, dict(params), ps.dp_cp_mesh)
        self.master_params = [p for m in self.masters for p in m.values()]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._events = ({"gathered": [torch.cuda.Event() for _ in range(2)],
                         "reduced": [torch.cuda.Event() for _ in range(2)]} if self.cuda else None)
        self._gen = 0  # forward passes so far: a slot holds (block, generation)
        self._holds: List[Optional[Tuple[int, int]]] = [None, None]
        self._waiting = [False, False]  # a slot's gather was issued on the side stream, not yet waited for
        self._reduced_here = [False, False]  # a reduction from a reduction slot was issued in this backward
        self._backward_open = False
        self._through_peers = False  # this backward's block gradients are summed by the copy engines
        self._pending = [0] * len(self.blocks)  # per block: main gradients not yet in this backward
        self._pending_resident = 0
        self._install_hooks()
        self.new_step()

    # ---- construction -----------------------------------------------------------------------------
    def _fp8_groups(self, named) -> Optional[List[int]]:
        """Each main piece's index in block 0's `fp8_weight_groups()`, where every block has such groups and
        they cover exactly the main pieces; else None."""
        groups = [getattr(b, "fp8_weight_groups", lambda: None)() for b in self.blocks]
        if any(g is None for g in groups):
            return None
        path_of = {id(p): path for path, p in named}
        group_of = {path_of.get(id(t)): g for g, tensors in enumerate(groups[0]) for t in tensors}
        paths = [piece.path for piece in self.pieces["main"]]
        if None in group_of or sorted(group_of) != sorted(paths):
            return None
        return [group_of[path] for path in paths]

    def _allocate(self, n_blocks: int, sizes, master_dtype: torch.dtype, device) -> None:
        zeros = functools.partial(torch.zeros, device=device)
        slots = {"main": 2, "resident": n_blocks}  # compute and reduction slots; padded rows stay zero
        # masters and their gradients: [block, shard] (this rank's rows of every parameter, padded)
        self.master = {k: zeros(n_blocks, sizes[k][0], dtype=master_dtype) for k in KINDS}
        self.grad = {k: zeros(n_blocks, sizes[k][0], dtype=master_dtype) for k in KINDS}
        self.slots = {k: zeros(slots[k], sizes[k][1], dtype=self.compute_dtype) for k in KINDS
                      if k != "main" or self.fp8_group is None}
        if self.fp8_group is not None:  # the GEMMs read the fp8 slots: the leaves only carry gradients, so
            # their slots are one element seen everywhere (the shapes autograd needs, no memory)
            self.slots["main"] = zeros(1, dtype=self.compute_dtype).expand(slots["main"], sizes["main"][1])
        self._writable = {k: v.data for k, v in self.slots.items()}  # writes here leave autograd's versions alone
        self._slot_shapes = {k: (slots[k], sizes[k][1]) for k in KINDS}
        self.reduce_slots: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}  # made on first use: _reduction_slots
        self._staging = ({k: torch.empty(sizes[k][0], dtype=self.compute_dtype, device=device) for k in KINDS}
                         if self.compute_dtype != master_dtype else None)  # a block's shard cast, to gather
        self._scratch = {k: torch.empty(sizes[k][0], dtype=master_dtype, device=device) for k in KINDS}
        if self.fp8_group is not None:  # fp8 gathers: two e4m3 slots, their groups' scales, a block's cast shard
            self.slots8 = zeros(2, sizes["main"][1], dtype=E4M3)
            self.scales8 = torch.ones(2, max(self.fp8_group) + 1, device=device)
            self._staging8 = torch.empty(sizes["main"][0], dtype=E4M3, device=device)
            self._fp8_index = torch.tensor(self.fp8_group, device=device)  # made here: a capture copies nothing in

    def _bind_block(self, i: int, params: Dict[str, nn.Parameter], mesh) -> None:
        """Block i's masters (its rows copied in, registered in its modules) and compute leaves."""
        from torch.distributed.tensor import DTensor, Shard
        leaves, masters, places = {}, {}, []
        block = self.blocks[i]
        for kind in KINDS:
            slot = self.slots[kind][i % 2 if kind == "main" else i]
            for n, piece in enumerate(self.pieces[kind]):
                p = params[piece.path]
                start = min(self.rank * piece.chunk, p.shape[0])
                real = min(piece.chunk, p.shape[0] - start)  # this rank's rows (the last ranks' may be fewer)

                def sharded(flat: torch.Tensor) -> torch.Tensor:  # this rank's rows in a [block, shard] buffer
                    local = flat[i, piece.shard_start:piece.shard_start + piece.shard_numel]
                    local = local.view((piece.chunk,) + tuple(p.shape[1:]))[:real]
                    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape,
                                              stride=p.stride())

                master = nn.Parameter(sharded(self.master[kind]))
                if not p.is_meta:
                    with torch.no_grad():
                        master.to_local().copy_(p.detach()[start:start + real])
                self._grad_views.append((master, sharded(self.grad[kind])))
                leaf = slot[piece.full_start:piece.full_start + p.numel()].view(p.shape).requires_grad_()
                if kind == "main" and self.fp8_group is not None:
                    leaf.fp8_weight = Fp8Weight(self.slots8[i % 2, piece.full_start:piece.full_start + p.numel()]
                                                .view(p.shape), self.scales8[i % 2, self.fp8_group[n]])
                module, name = module_and_name(block, piece.path)
                module._parameters[name] = master
                leaves[piece.path], masters[piece.path] = leaf, master
                places.append((module, name, leaf, master))
        self.leaves.append(leaves)
        self.masters.append(masters)
        self._places.append(places)

    def _install_hooks(self) -> None:
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(functools.partial(self._before_forward, i))
            block.register_forward_hook(functools.partial(self._after_forward, i))
            for kind in KINDS:
                for piece in self.pieces[kind]:
                    leaf = self.leaves[i][piece.path]
                    leaf.register_hook(functools.partial(self._on_grad, i, kind, piece))
                    # an eager .backward() would keep the gradient on the leaf too: every block's, whole
                    leaf.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))

    # ---- gathering and waiting ------------------------------------------------------------------------
    def _swap(self, i: int, use_leaves: bool) -> None:
        """Block i's modules hold its compute leaves (while it runs) or its masters (otherwise)."""
        for module, name, leaf, master in self._places[i]:
            module._parameters[name] = leaf if use_leaves else master

    def _side(self):
        """The context the collectives are issued in: the side stream after the compute so far (CUDA)."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def _gather(self, kind: str, block: int, slot: int) -> None:
        """This block's shards of `kind` from every rank into compute slot `slot` (its padding rows too)."""
        source = self.master[kind][block]
        if self._staging is not None:
            self._staging[kind].copy_(source)
            source = self._staging[kind]
        if kind == "main" and self.fp8_group is not None:
            return self._gather_fp8(source, slot)
        out = self._writable[kind][slot]
        fulls = [out[piece.full_start:piece.full_end] for piece in self.pieces[kind]]
        shards = [source[piece.shard_start:piece.shard_start + piece.shard_numel] for piece in self.pieces[kind]]
        if not fulls:
            return
        if self.ranks == 1:
            torch._foreach_copy_(fulls, shards)
        else:
            all_gather_many(fulls, shards, self.group)

    def _gather_fp8(self, source: torch.Tensor, slot: int) -> None:
        """A block's main shards (`source`, in the compute dtype) cast to e4m3 with their groups' scales,
        each group's amax the maximum over every rank's rows, then gathered into fp8 slot `slot`."""
        pieces = self.pieces["main"]
        shards = [source[p.shard_start:p.shard_start + p.shard_numel] for p in pieces]
        amaxes = torch.stack(torch._foreach_norm(shards, ord=float("inf"))).float()  # max |x| per piece
        group_amax = torch.zeros(self.scales8.shape[1], device=source.device).scatter_reduce(
            0, self._fp8_index, amaxes, "amax")
        if self.ranks > 1:
            dist.all_reduce(group_amax, op=dist.ReduceOp.MAX, group=self.group)
        for piece, shard, group in zip(pieces, shards, self.fp8_group):
            x8, _, scale = cast(shard.view(-1, piece.inner), E4M3, None, group_amax[group])
            self._staging8[piece.shard_start:piece.shard_start + piece.shard_numel].copy_(x8.view(-1))
            self.scales8[slot, group].copy_(scale)
        out = self.slots8[slot].view(torch.uint8)  # as bytes: not every backend moves fp8 dtypes
        fulls = [out[p.full_start:p.full_end] for p in pieces]
        staged = self._staging8.view(torch.uint8)
        shards8 = [staged[p.shard_start:p.shard_start + p.shard_numel] for p in pieces]
        if self.ranks == 1:
            torch._foreach_copy_(fulls, shards8)
        else:
            all_gather_many(fulls, shards8, self.group)

    def _prefetch(self, block: int) -> None:
        """Start gathering block `block`'s main parameters into its slot, unless it holds them for this pass."""
        slot = block % 2
        if self._holds[slot] == (block, self._gen):
            return
        with self._side():
            self._gather("main", block, slot)
            if self.cuda:
                self._events["gathered"][slot].record()
        self._holds[slot] = (block, self._gen)
        self._waiting[slot] = self.cuda

    def _ensure(self, block: int) -> None:
        """Block `block`'s main parameters in its slot for this pass, before the compute that reads them."""
        self._prefetch(block)
        slot = block % 2
        if self._waiting[slot]:
            torch.cuda.current_stream().wait_event(self._events["gathered"][slot])
            self._waiting[slot] = False

    def _join(self) -> None:
        """The compute stream waits for every collective issued so far (a capture must end joined)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
        self._waiting = [False, False]
        self._reduced_here = [False, False]

    # ---- forward ------------------------------------------------------------------------------------
    def _before_forward(self, i: int, module, args) -> None:
        if i == 0:  # a new pass: the weights may have changed since the slots were filled
            self._gen += 1
            with self._side():
                for block in range(len(self.blocks)):
                    self._gather("resident", block, block)
            self._join()
        self._ensure(i)
        if i + 1 < len(self.blocks):
            self._prefetch(i + 1)
        self._swap(i, use_leaves=True)

    def _after_forward(self, i: int, module, args, output) -> None:
        self._swap(i, use_leaves=False)
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad, i=i: self._before_backward(i))
        if i == len(self.blocks) - 1:
            self._join()

    # ---- backward -----------------------------------------------------------------------------------
    def _before_backward(self, i: int) -> None:
        """Runs when the gradient of block i's output is complete: block i + 1's backward is done."""
        n = len(self.blocks)
        if not self._backward_open:
            self._backward_open = True
            self._through_peers = self._reduces_through_peers()
            self._pending = [len(self.pieces["main"])] * n
            self._pending_resident = len(self.pieces["resident"]) * n
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        if i + 1 < n:
            self._swap(i + 1, use_leaves=False)
        if i + 2 < n and self._pending[i + 2]:  # block i's gradients would overwrite block i + 2's unreduced ones
            raise RuntimeError(f"{self._pending[i + 2]} parameter(s) of block {i + 2} got no gradient before block "
                               f"{i}'s backward began: {_EVERY_PARAMETER_USED}")
        if self.regather:
            self._ensure(i)
        if self._reduced_here[i % 2]:  # block i + 2's reduction still reads the reduction slot
            torch.cuda.current_stream().wait_event(self._events["reduced"][i % 2])
            self._reduced_here[i % 2] = False
        if i > 0 and self.regather:
            self._prefetch(i - 1)
        self._swap(i, use_leaves=True)  # a recomputed (checkpointed) forward reads the modules' weights

    def _on_grad(self, i: int, kind: str, piece: Piece, grad: Optional[torch.Tensor]) -> None:
        if grad is None:  # a graph replay's backward: the captured hooks ran inside it
            return
        slot = i % 2 if kind == "main" else i
        self._reduction_slots(kind)[slot][piece.full_start:piece.full_start + grad.numel()].view(grad.shape).copy_(grad)
        if kind == "main":
            self._pending[i] -= 1
            if self._pending[i] == 0:
                self._reduce("main", [i])
        else:
            self._pending_resident -= 1
            if self._pending_resident == 0:
                self._reduce("resident", range(len(self.blocks)))

    def _reduce(self, kind: str, blocks: Sequence[int]) -> None:
        """Sum the blocks' gradients of `kind` over the group and add this rank's rows, divided by dp, to
        their gradient buffers (micro-batches accumulate)."""
        with self._side():
            for i in blocks:
                slot = i % 2 if kind == "main" else i
                reduction = self._reduction_slots(kind)[slot]
                fulls = [reduction[piece.full_start:piece.full_end] for piece in self.pieces[kind]]
                if not fulls:
                    continue
                if kind == "main" and self._through_peers:  # the chunks in order: the gradient buffer's layout
                    summed = peer_collectives.reduce_scatter_pieces(fulls, self.group, self.master_dtype)
                    self.grad[kind][i].add_(summed, alpha=1.0 / self.ranks)
                    continue
                out = self._scratch[kind]  # one per kind: the reductions follow each other on one stream
                shards = [out[piece.shard_start:piece.shard_start + piece.shard_numel] for piece in self.pieces[kind]]
                if self.ranks == 1:
                    torch._foreach_copy_(shards, fulls)
                else:
                    reduce_scatter_many(shards, fulls, self.group)
                self.grad[kind][i].add_(out, alpha=1.0 / self.ranks)
            if self.cuda and kind == "main":
                self._events["reduced"][blocks[0] % 2].record()
        if kind == "main":
            self._reduced_here[blocks[0] % 2] = self.cuda

    def _reduces_through_peers(self) -> bool:
        """Whether this backward's block gradients are summed by the copy engines (module docstring): the
        comm backend sends this work there, and they are narrower than the masters. Asked once per
        backward, on every rank alike (the first answer per group is a collective, outside capture)."""
        if self.ranks == 1 or self.compute_dtype.itemsize >= self.master_dtype.itemsize:
            return False
        return peer_collectives.use_copy_engine(self._scratch["main"], self.group)

    def _reduction_slots(self, kind: str) -> torch.Tensor:
        """The reduction slots of `kind` [slots, slot elements] for this backward: in the compute dtype for
        the copy engines' sum, else in the masters' (fp32) dtype. Made zero on first use (padding rows
        stay zero); the eager warm-up before a capture makes those the capture uses."""
        dtype = self.compute_dtype if kind == "main" and self._through_peers else self.master_dtype
        if (kind, dtype) not in self.reduce_slots:
            self.reduce_slots[(kind, dtype)] = torch.zeros(self._slot_shapes[kind], dtype=dtype, device=self.device)
        return self.reduce_slots[(kind, dtype)]

    def _after_backward(self) -> None:
        self._backward_open = False
        self._join()
        self._swap(0, use_leaves=False)
        missing = sum(self._pending) + self._pending_resident
        if missing:  # every rank runs the same blocks: all raise here alike
            raise RuntimeError(f"{missing} block parameter(s) got no gradient: {_EVERY_PARAMETER_USED}")

    # ---- the step -----------------------------------------------------------------------------------
    def wait_for_gradients(self) -> None:
        """Make the current stream wait for the gradient reductions (they run on a side stream): call on
        the thread that ran the backward, before anything reads the gradients. A no-op on CPU."""
        self._join()

    def new_step(self) -> None:
        """After the optimizer step and zero_grad: the masters' gradients are this object's buffers again,
        zeroed; the backwards until the next new_step add to them."""
        for grads in self.grad.values():
            grads.zero_()
        for master, grad in self._grad_views:
            master.grad = grad

    def capture_cuda_graphs(self, model: nn.Module, batch_size: int, seq_len: int) -> None:
        """`model.capture_cuda_graphs(batch_size, seq_len)` with these blocks' gathers and reductions inside
        the graphs (under the caller's autocast). FSDP2's root unit is unsharded meanwhile (the embedding
        makes the capture's sample input); the capture's passes leave no gradient behind."""
        root = model if hasattr(model, "unshard") else None
        if root is not None:
            root.unshard()
        model.capture_cuda_graphs(batch_size, seq_len, dp_sync=self.graph_sync())
        if root is not None:
            root.reshard()
        self.new_step()

    def graph_sync(self) -> "GraphSync":
        """What GraphedBlocks needs to capture these blocks (GPT.capture_cuda_graphs(..., dp_sync=)): the
        gathers and reductions are then part of the captured forward and backward."""
        return GraphSync(self)

    def bytes_per_rank(self) -> Dict[str, int]:
        """What this rank holds for the blocks: sharded weights and gradients, AdamW's two moments of the
        sharded weights, and the compute and reduction slots (with the cast shard they are gathered from)."""
        def size(tensors):  # the memory behind them (under fp8 gathers the main slots are one element)
            return sum(t.untyped_storage().nbytes() for t in tensors)
        staging = size(self._staging.values()) if self._staging else 0
        if self.fp8_group is not None:
            staging += size([self.slots8, self.scales8, self._staging8])
        return {"params": size(self.master.values()), "grads": size(self.grad.values()),
                "adam_state": 2 * size(self.master.values()),
                "slots": size(self.slots.values()) + size(self.reduce_slots.values()) + staging}  # made so far


class GraphSync:
    """The graphed stack's view of a ShardedBlocks: the tensors the captured graphs differentiate (the
    compute leaves, whose gradients the hooks take: none is returned), and the calls GraphedBlocks
    makes around a capture and its replays. The hooks themselves run while the blocks are captured,
    so the graphs carry them."""

    collect_gradients = False  # the hooks take each leaf's gradient and drop it: none is kept for the stack

    def __init__(self, sharded: ShardedBlocks):
        self.sharded = sharded
        self.hooked = frozenset(id(t) for leaves in sharded.leaves for t in leaves.values())

    def graph_params(self) -> List[torch.Tensor]:
        return [t for leaves in self.sharded.leaves for t in leaves.values()]

    def warm_up(self) -> None:
        """After the eager warm-up passes, before the capture: their gradients are dropped."""
        self.sharded.new_step()

    def before_block(self, index: int) -> None:
        pass

    def after_blocks(self) -> None:
        pass

    @contextlib.contextmanager
    def gradient_hooks(self):
        """Around the captured backward: the capturing stream joins the side stream at its end."""
        yield
        self.sharded.wait_for_gradients()

    def backward_replayed(self) -> None:
        pass

    def wait_all(self) -> None:
        self.sharded._join()


def shard_blocks(model: nn.Module, ps: ParallelState, compute_dtype: Optional[torch.dtype] = None,
                 fp8_gathers: bool = True) -> ShardedBlocks:
    """fsdp=zero3 for `model`: its blocks through ShardedBlocks, everything else with FSDP2 on the root
    unit (fp32 reduction; `compute_dtype` for its all-gathers too). Every parameter is then a DTensor
    sharded over `ps.dp_cp_mesh`. `fp8_gathers`: gather the blocks' weights in fp8 where their GEMMs
    allow it (ShardedBlocks' docstring). Collective: call on every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    sharded = ShardedBlocks(model, ps, compute_dtype, fp8_gathers)
    rest = [p for p in model.parameters() if not hasattr(p, "device_mesh")]
    if rest:
        fully_shard(model, mesh=ps.dp_cp_mesh, reshard_after_forward=False, ignored_params=set(sharded.master_params),
                    mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32))
    return sharded


def materialize_outside_blocks(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device=device)` for a model built on the meta device and sharded with
    shard_blocks: storage for everything outside its blocks (FSDP2's root unit; children before the
    root, whose FSDP state then takes the new shards), while the blocks' masters keep theirs."""
    inside = {id(m) for block in getattr(model, "blocks", []) for m in block.modules()}
    for module in reversed(list(model.modules())):  # every module after its descendants
        if id(module) not in inside:
            module.to_empty(device=device, recurse=False)

