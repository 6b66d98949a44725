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
  runs forward, its shards are all-gathered into its slot (block i + 1's while block i computes);
  in the backward, block i's slot is gathered again before its backward (the last two blocks still
  hold theirs), while block i + 1's backward computes;
- gradients: a hook on each leaf copies its gradient (fp32) into a reduction slot; when a block's
  last one is in, one reduce-scatter per parameter leaves this rank's rows of the sum, divided by
  dp, in the block's gradient buffer, while the blocks before it compute theirs;
- the blocks' tp-partial-gradient parameters (norm weights under sequence parallelism: summed over
  tp in autograd at the end of the stack's backward) are sharded too, but gathered for all blocks at
  once at the start of the forward, kept until the next one (they are small), and reduced after
  the backward.

Everything outside the blocks (embeddings, final norm, head) is left to FSDP2 on the model's root
unit (`shard_blocks`): those run eagerly anyway. Communication per step is FSDP's (an all-gather in
the forward and in the backward, a reduce-scatter); memory per rank is the sharded fp32 weights,
gradients and AdamW state (16 / dp bytes per parameter) plus the two compute slots and two
reduction slots of one block (`bytes_per_rank`).

On CUDA the collectives run on a side stream, ordered against the compute by events recorded in the
same forward or backward; on CPU they run inline. Capture (tpflash.layers.graphed_blocks) records
the same schedule: every decision (which slot holds which block, what to gather) is the same at
every step, because every forward gathers every block again (the weights changed).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .comm import _issue_all_gather, _issue_reduce_scatter
from .state import ParallelState


@dataclass
class _Piece:
    """One block parameter: its module and attribute, shape, and places in the flat buffers."""
    path: str  # name within the block, e.g. "attn.qkv_proj.weight"
    shape: torch.Size
    chunk: int  # rows per rank: ceil(rows / ranks)
    shard_start: int  # in a block's flat shard (chunk * inner elements)
    full_start: int  # in a compute slot (ranks * chunk * inner elements: padded rows)

    @property
    def inner(self) -> int:
        return self.shape[1:].numel()

    @property
    def shard_numel(self) -> int:
        return self.chunk * self.inner


def _layout(named: List[Tuple[str, nn.Parameter]], ranks: int) -> Tuple[List[_Piece], int, int]:
    """The pieces of one block's parameters, the shard numel and the padded full numel."""
    pieces, shard, full = [], 0, 0
    for path, p in named:
        if p.dim() == 0:
            raise ValueError(f"fsdp=zero3 shards parameters by rows: {path} is a scalar")
        chunk = -(-p.shape[0] // ranks)
        pieces.append(_Piece(path, p.shape, chunk, shard, full))
        shard += chunk * p.shape[1:].numel()
        full += ranks * chunk * p.shape[1:].numel()
    return pieces, shard, full


def _stacking_order(block: nn.Module, named: List[Tuple[str, nn.Parameter]]) -> List[Tuple[str, nn.Parameter]]:
    """The block's parameters with each group its layers multiply stacked (q/k/v, up/gate:
    `weight_cast_groups`) side by side, so that the gathered group is one view of the slot rather
    than a copy (weight_casts.stacked_cast); the rest in module order."""
    path_of = {id(p): (n, p) for n, p in named}
    groups = getattr(block, "weight_cast_groups", list)()
    first = [path_of[id(t)] for g in groups if len(g) > 1 for t in g if t is not None and id(t) in path_of]
    taken = {n for n, _ in first}
    return first + [(n, p) for n, p in named if n not in taken]


def _split_path(block: nn.Module, path: str) -> Tuple[nn.Module, str]:
    module_path, _, name = path.rpartition(".")
    return (block.get_submodule(module_path) if module_path else block), name


class ShardedBlocks:
    """ZeRO-3 for `model.blocks` over `ps.dp_cp_group` (module docstring).

    Construct it on every rank once the blocks' weights are final and alike on every dp rank, before
    the optimizer (which then steps the sharded masters) and before any CUDA-graph capture.
    `compute_dtype`: the dtype of the gathered weights (bf16 under autocast on CUDA; default the
    parameters' own). Per step: forward and backward (the hooks gather and reduce), the optimizer
    step on the masters, `optimizer.zero_grad(set_to_none=True)`, then `new_step()` (micro-batches
    accumulate until then, graphed or not).
    Collectives over the dp * cp group, inside the blocks' forward and backward.
    """

    def __init__(self, model: nn.Module, ps: ParallelState, compute_dtype: Optional[torch.dtype] = None):
        from torch.distributed.tensor import DTensor, Shard
        self.group, self.ranks, self.rank = ps.dp_cp_group, ps.dp_cp_size, ps.dp_cp_rank
        self.blocks = list(getattr(model, "blocks", []))
        if not self.blocks:
            raise ValueError("fsdp=zero3 shards a model's transformer blocks: this model has no `blocks`")
        named = [[(n, p) for n, p in b.named_parameters() if p.requires_grad] for b in self.blocks]
        template = [(n, tuple(p.shape), p.dtype) for n, p in named[0]]
        for i, params in enumerate(named):
            if [(n, tuple(p.shape), p.dtype) for n, p in params] != template:
                raise ValueError(f"fsdp=zero3 needs blocks of one shape: block {i}'s parameters differ from block 0's")
            if any(type(p) is not nn.Parameter for _, p in params):
                raise ValueError("fsdp=zero3 needs plain parameters (is the model already sharded with FSDP?)")
        named = [_stacking_order(b, params) for b, params in zip(self.blocks, named)]
        partial_ids = {id(p) for p in getattr(self.blocks[0], "tp_partial_grad_parameters", list)()}
        is_partial = [id(p) in partial_ids for _, p in named[0]]
        dtypes = {p.dtype for _, p in named[0]}
        if len(dtypes) != 1:
            raise ValueError(f"fsdp=zero3 needs the block parameters in one dtype, got {sorted(map(str, dtypes))}")
        master_dtype, device = dtypes.pop(), named[0][0][1].device
        self.compute_dtype = compute_dtype or master_dtype
        self.cuda = device.type == "cuda"
        L = len(self.blocks)
        self.main, s_main, f_main = _layout([x for x, part in zip(named[0], is_partial) if not part], self.ranks)
        self.partial, s_part, f_part = _layout([x for x, part in zip(named[0], is_partial) if part], self.ranks)
        zeros = functools.partial(torch.zeros, device=device)
        # masters and their gradients: [block, shard] (this rank's rows of every parameter, padded)
        self.master = {"main": zeros(L, s_main, dtype=master_dtype), "partial": zeros(L, s_part, dtype=master_dtype)}
        self.grad = {"main": zeros(L, s_main, dtype=master_dtype), "partial": zeros(L, s_part, dtype=master_dtype)}
        # compute slots: two for the main set, one per block for the partial set; padded rows stay zero
        self.slots = {"main": zeros(2, f_main, dtype=self.compute_dtype),
                      "partial": zeros(L, f_part, dtype=self.compute_dtype)}
        self._writable = {k: v.data for k, v in self.slots.items()}  # writes here leave autograd's versions alone
        self.reduce_slots = {"main": zeros(2, f_main, dtype=master_dtype), "partial": zeros(L, f_part, dtype=master_dtype)}
        self._staging = {k: torch.empty_like(v[0], dtype=self.compute_dtype) for k, v in self.master.items()} \
            if self.compute_dtype != master_dtype else None
        self._scratch = {k: torch.empty_like(v[0]) for k, v in self.grad.items()}  # a block's reduced shard
        self.leaves: List[Dict[str, torch.Tensor]] = []  # per block: path -> compute leaf
        self.masters: List[Dict[str, nn.Parameter]] = []  # per block: path -> DTensor master
        self._grad_views: List[Tuple[nn.Parameter, torch.Tensor]] = []
        mesh = ps.dp_cp_mesh
        for i, (block, params) in enumerate(zip(self.blocks, named)):
            by_path = dict(params)
            leaves, masters = {}, {}
            for kind, pieces in (("main", self.main), ("partial", self.partial)):
                slot = self.slots[kind][i % 2 if kind == "main" else i]
                for piece in pieces:
                    p = by_path[piece.path]
                    start, end = piece.full_start, piece.full_start + p.numel()
                    leaf = slot[start:end].view(p.shape)
                    leaves[piece.path] = leaf.requires_grad_()
                    masters[piece.path] = self._make_master(p, piece, i, kind, mesh, DTensor, Shard)
                    module, name = _split_path(block, piece.path)
                    module._parameters[name] = masters[piece.path]
            self.leaves.append(leaves)
            self.masters.append(masters)
        self.master_params = [p for m in self.masters for p in m.values()]
        self._gen = 0  # forward passes so far: a slot holds (block, generation)
        self._holds: List[Optional[Tuple[int, int]]] = [None, None]
        self._events = self._new_events() if self.cuda else None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._backward_open = False
        self._waiting = [False, False]  # a slot's gather was issued on the side stream, not yet waited for
        self._reduced_here = [False, False]  # a reduction from a slot was issued in this backward
        self._hook_handles = []
        self._install_hooks()
        self.new_step()

    # ---- construction -----------------------------------------------------------------------------
    def _make_master(self, p, piece: _Piece, block: int, kind: str, mesh, DTensor, Shard) -> nn.Parameter:
        """Copy this rank's rows of p into the block's flat shard; the DTensor parameter over them."""
        rows = p.shape[0]
        start = min(self.rank * piece.chunk, rows)
        real = min(piece.chunk, rows - start)
        flat = self.master[kind][block, piece.shard_start:piece.shard_start + piece.shard_numel]
        local = flat.view((piece.chunk,) + tuple(p.shape[1:]))[:real]
        with torch.no_grad():
            local.copy_(p.detach()[start:start + real])
        master = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape,
                                                 stride=p.stride()))
        grad_flat = self.grad[kind][block, piece.shard_start:piece.shard_start + piece.shard_numel]
        grad = DTensor.from_local(grad_flat.view((piece.chunk,) + tuple(p.shape[1:]))[:real], mesh, [Shard(0)],
                                  run_check=False, shape=p.shape, stride=p.stride())
        self._grad_views.append((master, grad))
        return master

    def _new_events(self):
        return {"gathered": [torch.cuda.Event(), torch.cuda.Event()], "reduced": [torch.cuda.Event(), torch.cuda.Event()]}

    def _install_hooks(self) -> None:
        L = len(self.blocks)
        self._pending = [0] * L
        self._pending_partial = 0
        for i, block in enumerate(self.blocks):
            self._hook_handles.append(block.register_forward_pre_hook(functools.partial(self._before_forward, i)))
            self._hook_handles.append(block.register_forward_hook(functools.partial(self._after_forward, i)))
            for kind, pieces in (("main", self.main), ("partial", self.partial)):
                for piece in pieces:
                    leaf = self.leaves[i][piece.path]
                    leaf.register_hook(functools.partial(self._on_grad, i, kind, piece))
                    # an eager .backward() would keep the gradient on the leaf too: every block's, whole
                    leaf.register_post_accumulate_grad_hook(lambda t: setattr(t, "grad", None))

    # ---- the weights a block computes with ----------------------------------------------------------
    def _swap(self, i: int, use_leaves: bool) -> None:
        source = self.leaves[i] if use_leaves else self.masters[i]
        for path, tensor in source.items():
            module, name = _split_path(self.blocks[i], path)
            module._parameters[name] = tensor

    def _side(self):
        """The context the collectives are issued in: the side stream after the compute so far (CUDA)."""
        if not self.cuda:
            return _nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def _gather(self, kind: str, block: int, slot: int) -> None:
        """This block's shards of `kind` from every rank into compute slot `slot`, unpadded rows and all."""
        source = self.master[kind][block]
        if self._staging is not None:
            self._staging[kind].copy_(source)
            source = self._staging[kind]
        out = self._writable[kind][slot]
        for piece in (self.main if kind == "main" else self.partial):
            full = out[piece.full_start:piece.full_start + self.ranks * piece.shard_numel]
            shard = source[piece.shard_start:piece.shard_start + piece.shard_numel]
            if self.ranks == 1:
                full.copy_(shard)
            else:
                _issue_all_gather(full, shard, self.group).wait()

    def _ensure(self, block: int) -> None:
        """Block `block`'s main parameters in its slot for this pass, gathered now if not prefetched."""
        slot = block % 2
        if self._holds[slot] != (block, self._gen):
            self._prefetch(block)
        if self.cuda and self._waiting[slot]:
            torch.cuda.current_stream().wait_event(self._events["gathered"][slot])
            self._waiting[slot] = False

    def _prefetch(self, block: int) -> None:
        slot = block % 2
        if self._holds[slot] == (block, self._gen):
            return
        with self._side():
            self._gather("main", block, slot)
            if self.cuda:
                self._events["gathered"][slot].record()
        self._holds[slot] = (block, self._gen)
        self._waiting[slot] = self.cuda

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
            self._waiting, self._reduced_here = [False, False], [False, False]
            with self._side():
                for block in range(len(self.blocks)):
                    self._gather("partial", block, block)
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
        L = len(self.blocks)
        if not self._backward_open:
            self._backward_open = True
            self._pending = [len(self.main)] * L
            self._pending_partial = len(self.partial) * L
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        if i + 1 < L:
            self._swap(i + 1, use_leaves=False)
        if i + 2 < L and self._pending[i + 2]:  # block i's gradients would overwrite block i + 2's unreduced ones
            raise RuntimeError(f"fsdp=zero3: block {i + 2}'s parameter gradients were not all delivered before "
                               f"block {i}'s backward began ({self._pending[i + 2]} missing)")
        self._ensure(i)
        if self.cuda and self._reduced_here[i % 2]:  # block i + 2's reduction still reads the reduction slot
            torch.cuda.current_stream().wait_event(self._events["reduced"][i % 2])
            self._reduced_here[i % 2] = False
        if i > 0:
            self._prefetch(i - 1)
        self._swap(i, use_leaves=True)  # a recomputed (checkpointed) forward reads the modules' weights

    def _on_grad(self, i: int, kind: str, piece: _Piece, grad: Optional[torch.Tensor]) -> None:
        if grad is None:  # a graph replay's backward: the captured hooks ran inside it
            return
        slot = i % 2 if kind == "main" else i
        full = self.reduce_slots[kind][slot][piece.full_start:piece.full_start + self.ranks * piece.shard_numel]
        full[:grad.numel()].view(grad.shape).copy_(grad)
        if kind == "main":
            self._pending[i] -= 1
            if self._pending[i] == 0:
                self._reduce("main", [i])
        else:
            self._pending_partial -= 1
            if self._pending_partial == 0:
                self._reduce("partial", range(len(self.blocks)))

    def _reduce(self, kind: str, blocks) -> None:
        """Sum the blocks' gradients of `kind` over the group into this rank's rows, divided by dp."""
        pieces = self.main if kind == "main" else self.partial
        with self._side():
            for i in blocks:
                slot = i % 2 if kind == "main" else i
                out = self._scratch[kind]  # one per kind: the reductions follow each other on one stream
                for piece in pieces:
                    full = self.reduce_slots[kind][slot][piece.full_start:piece.full_start + self.ranks * piece.shard_numel]
                    shard = out[piece.shard_start:piece.shard_start + piece.shard_numel]
                    if self.ranks == 1:
                        shard.copy_(full)
                    else:
                        _issue_reduce_scatter(shard, full, self.group).wait()
                self.grad[kind][i].add_(out, alpha=1.0 / self.ranks)  # micro-batches accumulate
            if self.cuda and kind == "main":
                self._events["reduced"][blocks[0] % 2].record()
        if kind == "main":
            self._reduced_here[blocks[0] % 2] = self.cuda

    def _after_backward(self) -> None:
        self._backward_open = False
        self._join()
        self._swap(0, use_leaves=False)
        missing = sum(self._pending) + self._pending_partial
        if missing:  # every rank runs the same blocks: all raise here alike
            raise RuntimeError(f"{missing} block parameter(s) got no gradient: fsdp=zero3 needs every block "
                               "parameter used in the forward")

    # ---- the step -----------------------------------------------------------------------------------
    def new_step(self) -> None:
        """After the optimizer step and zero_grad: the masters' gradients are this object's buffers again,
        zeroed; the backwards until the next new_step add to them."""
        for kind in self.grad:
            self.grad[kind].zero_()
        for master, grad in self._grad_views:
            master.grad = grad

    def graph_sync(self) -> "GraphSync":
        """What GraphedBlocks needs to capture these blocks (GPT.capture_cuda_graphs(..., dp_sync=)): the
        gathers and reductions are then part of the captured forward and backward."""
        return GraphSync(self)

    def bytes_per_rank(self) -> Dict[str, int]:
        """What this rank holds for the blocks: sharded weights and gradients, the compute and reduction
        slots, and AdamW's two moments of the sharded weights."""
        size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
        return {"params": size(self.master.values()), "grads": size(self.grad.values()),
                "adam_state": 2 * size(self.master.values()),
                "slots": size(self.slots.values()) + size(self.reduce_slots.values())
                + (size(self._staging.values()) if self._staging else 0)}


class GraphSync:
    """The graphed stack's view of a ShardedBlocks: the tensors the captured graphs differentiate (the
    compute leaves, whose gradients the hooks take: none is returned), and the checks around the
    replays. The hooks themselves run while the blocks are captured, so the graphs carry them."""

    cast_weights = False  # the gathered weights are in the compute dtype already

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

    def gradient_hooks(self):
        return _nullcontext()

    def backward_replayed(self) -> None:
        pass

    def wait_all(self) -> None:
        self.sharded._join()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def shard_blocks(model: nn.Module, ps: ParallelState, compute_dtype: Optional[torch.dtype] = None) -> ShardedBlocks:
    """fsdp=zero3 for `model`: its blocks through ShardedBlocks, everything else with FSDP2 on the root
    unit (fp32 reduction; `compute_dtype` for its all-gathers too). Every parameter is then a DTensor
    sharded over `ps.dp_cp_mesh`. Collective: call on every rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    sharded = ShardedBlocks(model, ps, compute_dtype)
    rest = [p for p in model.parameters() if not hasattr(p, "device_mesh")]
    if rest:
        fully_shard(model, mesh=ps.dp_cp_mesh, reshard_after_forward=False, ignored_params=set(sharded.master_params),
                    mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32))
    return sharded


def sharded_bytes_per_param(dp: int) -> float:
    """Memory per parameter a rank holds under ZeRO-3 with AdamW in fp32: 16 / dp (weight, gradient and
    two moments, each sharded), besides the slots of one block."""
    return 16 / dp
