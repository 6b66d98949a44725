"""A stack of transformer blocks replayed as two CUDA graphs: one for its forward, one for its backward.

Under tensor parallelism a training step issues, per block and direction, dozens of kernels and
collectives, each with its own Python and launch cost; at tp=2 on fast GPUs the host then takes
longer to issue a step than the GPUs take to run it (docs/performance.md, "End-to-end, two H200s"). Captured
once, the whole stack's forward (every block, its collectives included) is one `replay()`, and so
is its backward (activation gradients, parameter gradients, and one all-reduce of all the
sequence-parallel partial gradients): the host cost of the stack no longer grows with its depth.

What a replay assumes, checked where it can be:
- the same input shape, dtype and device, grad mode on, the same autocast state and the same
  `training` flag as at capture; any other call runs the blocks eagerly (`matches`);
- one backward per forward, in order: a second forward overwrites the saved activations, so the
  backward of the first raises instead of computing wrong gradients;
- parameters stay where they were (in-place optimizer updates are fine; re-materialising them,
  e.g. FSDP, is not), no dropout (its random stream would not advance); activation checkpointing
  ("full" or "mlp") is captured too: the forward graph keeps each checkpointed block's inputs only
  and the backward graph recomputes the rest; whether the tp collectives overlap the GEMMs is
  decided once, at capture (tpflash.parallel.overlap.capture_decision, set on the blocks' layers for
  the capture), and replayed as captured: a layer's own flag if set (`set_overlap`), else
  TPFLASH_OVERLAP if set, else overlapped through the copy engines where the GPUs map each other's
  memory (measured faster than serial collectives there: docs/overlap.md) and serial NCCL
  collectives elsewhere; serial collectives go through the copy engines where they
  can (TPFLASH_COMM_BACKEND's default, "auto"), else through NCCL. The warm-up passes size the
  symmetric-memory workspaces so that capture allocates nothing;
- each block but the last hands the next block's norm its MLP's reduce-scatter parts unsummed,
  which that norm's kernel adds (ParallelTransformerBlock.hand_output_parts, set for the capture);
  in the backward, the q/k/v and up projections hand the norm before them their input gradient's
  reduce-scatter parts unsummed, which that norm's backward kernel adds (take_input_grad_parts);
- each block's output projection runs work its block hands it while its transfers travel
  (tpflash.parallel.held_work): in the forward graph the next block's weight casts, in the backward
  graph the up projection's weight gradient, computed late: every gradient is complete when the
  replay ends, but a hook on a parameter would see it early, so a capture holds no gradient back
  where any parameter has a gradient hook or dp_sync reduces gradients as they come; the overlapped
  column layers keep their gathered inputs in buffers of their own (peer_collectives.kept_buffer),
  valid for the one backward per forward above;
- the stack's outputs and gradients live in the graphs' memory: a tensor kept from one replay is
  overwritten by the next. Parameter gradients are the exception made safe: a `.grad` still
  holding graph memory when a forward replays (gradient accumulation) is copied out first, once
  per extra micro-batch; `zero_grad(set_to_none=True)` between steps avoids even that. Where the
  caller says micro-batches accumulate (`accumulate_grads`), nothing is copied: the weight-gradient
  GEMMs add into fp32 buffers of the weights' own (tpflash.layers.main_grads), which are their
  .grad, and the weights are cast to the compute dtype once per change of their values (before a
  forward replay, eagerly), not in every micro-batch's forward graph.

On CPU the same class runs with an eager stand-in for the graph (`replay()` reruns the captured
function into the same Python slots): no speed-up, but every line of the plumbing around the
replays (static inputs, the autograd Function, gradient accumulation) runs in CI under gloo.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..parallel import comm, overlap
from ..parallel.held_work import holding_gradients
from . import weight_casts
from .graph_capture import NO_AUTOCAST, CudaGraph, EagerGraph, autocast_for, autocast_state
from .main_grads import MainGrads

WARMUP_ITERS = 3  # eager forward+backward passes before capture: autotuning, cuBLAS and NCCL set-up


def check_graphable(blocks: Sequence[nn.Module], params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Raise ValueError naming the first setting of `blocks` that a captured replay would get wrong.
    `params`: the tensors the replays differentiate (default: the blocks' parameters)."""
    for i, block in enumerate(blocks):
        if getattr(block, "dropout", 0.0):
            raise ValueError(f"block {i} has dropout={block.dropout}: CUDA graphs need dropout=0 "
                             "(a replay would reuse one random mask)")
    params = [p for b in blocks for p in b.parameters()] if params is None else params
    if any(type(p.data) is not torch.Tensor for p in params):
        raise ValueError("the blocks' parameters are not plain tensors (FSDP/DTensor?): CUDA graphs need "
                         "parameters that stay in place")


class GraphedBlocks:
    """blocks[0](x, None) -> ... -> blocks[-1] as a captured forward and backward.

    `sample_x`: an input like the ones to replay, e.g. the embedding output [seq(/tp), batch, hidden];
    the forward is captured under the caller's autocast (its dtype, never its cache), the backward outside
    it (NO_AUTOCAST); grad mode must be on.
    Calling returns (out, residual) of the last block, differentiable in x and in every block
    parameter, like the eager loop. The blocks' collectives use their own process groups; every
    rank of those groups must capture together. `overlapped`: whether the capture overlapped the
    tp collectives with the GEMMs (the layers' flags, else tpflash.parallel.overlap.capture_decision). `dp_sync`: a
    tpflash.parallel.zero_graphs.GraphSync whose dp reduce-scatters and all-gathers the graphs
    overlap with the blocks (fsdp=zero1), or a tpflash.parallel.zero3.GraphSync (fsdp=zero3: the
    replays differentiate its gathered weights' leaves); its gradients are then written in place,
    not returned. `accumulate_grads`: several forwards and backwards run per optimizer step (gradient
    accumulation): without dp_sync or gradient hooks the weights' gradients are then added into their
    main_grad buffers by the GEMMs, and the weight casts leave the forward graph (module docstring).
    """

    def __init__(self, blocks: Sequence[nn.Module], sample_x: torch.Tensor, dp_sync=None,
                 accumulate_grads: bool = False):
        if not blocks:
            raise ValueError("GraphedBlocks needs at least one block")
        if not torch.is_grad_enabled():
            raise ValueError("capture the blocks with grad mode on (their backward is captured too)")
        graph_params = getattr(dp_sync, "graph_params", None)  # fsdp=zero3: the gathered weights' leaves
        self.params = tuple(graph_params() if graph_params is not None else
                            (p for b in blocks for p in b.parameters() if p.requires_grad))
        check_graphable(blocks, self.params)
        self.blocks = list(blocks)
        self.dp_sync = dp_sync
        # selective recomputation replays each op of a block's forward and must meet the same ones in its
        # backward, where the stack's casts and gradient aliases are not given: each block makes its own then
        self.stack_scopes = not any(getattr(b, "checkpoint", None) == "selective" for b in self.blocks)
        device = sample_x.device
        # the gradients dp_sync's hooks write in place inside the backward graph: not returned
        taken = dp_sync.hooked if dp_sync is not None else frozenset()
        # weight-gradient GEMMs held back within each block's backward: sound where nothing reads a gradient
        # before the stack's backward returns, i.e. without dp_sync's per-gradient hooks or anyone else's
        hooked = dp_sync is not None or any(getattr(p, "_backward_hooks", None) for p in self.params)
        self.held = [] if hooked else [b.held_work for b in self.blocks
                                       if getattr(b, "held_work", None) is not None]
        self.returned = tuple(id(p) not in taken for p in self.params)
        self.main_grads = self._main_grads() if accumulate_grads and not hooked else None
        # accumulating, the weights change only between optimizer steps: cast once per change, outside the graphs
        self.hoisted_casts = self._pending_casts(sample_x) if accumulate_grads and dp_sync is None else None
        self._cast_versions: Optional[List[int]] = None  # the cast weights' version counters when last cast
        self._step_hook = None
        if self.hoisted_casts is not None:  # torch's fused AdamW updates in place without bumping versions
            self._step_hook = _cast_again_after_optimizer_steps(self)
        self.autocast_state = autocast_state(device.type)
        self.training = self.blocks[0].training
        self.key = (tuple(sample_x.shape), sample_x.dtype, device)
        self.static_x = sample_x.detach().clone().requires_grad_(True)
        self.outputs: Tuple[torch.Tensor, ...] = ()
        self.input_grads: Tuple[Optional[torch.Tensor], ...] = ()
        self.forward_generation = 0  # bumped by every forward replay; a backward must match it
        self.backward_generation = 0
        group = getattr(self.blocks[0], "process_group", None)
        decision = overlap.capture_decision(sample_x, group)  # the default path, decided once per capture
        with overlap.overlapping_for_capture(self.blocks, decision) as overlapped, self._handing_parts_on():
            self.overlapped = overlapped
            self._capture(device)
        if self.main_grads is not None:  # the weights whose layers added into main_grad returned nothing
            self.main_grads.keep_only([p for p, g in zip(self.params, self.input_grads[1:]) if g is None])
        if device.type == "cuda":
            torch.cuda.synchronize()
            # The captured autograd graph is spent (its replays need only the static tensors), and
            # holding it would keep the parameters' AccumulateGrad nodes on the capture stream.
            self.outputs = tuple(o.detach() for o in self.outputs)

    def _capture(self, device: torch.device) -> None:
        self._refresh_casts()
        if device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            self.fwd_graph, self.bwd_graph = CudaGraph(pool), CudaGraph(pool)
            self._warm_up()
            if self.dp_sync is not None:
                self.dp_sync.warm_up()
        else:
            self.fwd_graph = EagerGraph(device.type, self.autocast_state)
            self.bwd_graph = EagerGraph(device.type, NO_AUTOCAST)
        with autocast_for(device.type, self.autocast_state):
            self.fwd_graph.capture(self._forward)
        self.static_grad_out = tuple(torch.empty_like(o) for o in self.outputs)
        with autocast_for(device.type, NO_AUTOCAST):
            self.bwd_graph.capture(self._backward)

    @contextlib.contextmanager
    def _handing_parts_on(self):
        """For the capture, every block but the last hands its output to the next block's norm as the
        reduce-scatter's parts, unsummed (ParallelTransformerBlock.hand_output_parts), where that norm
        adds them at once (a block that recomputes its forward later would read them after the
        buffers they lie in were written again): the stack's own outputs stay whole tensors. And in
        the backward, each block's q/k/v and up projections hand their input gradient's parts to the
        norm before them, whose kernel adds them (ParallelTransformerBlock.take_input_grad_parts), and
        each norm after a row layer writes that layer's output gradient where its backward gathers it
        (norms_write_row_grads; the first block's attn_norm follows the embedding, not a row layer)."""
        handing = [b for b, nxt in zip(self.blocks, self.blocks[1:])
                   if hasattr(b, "hand_output_parts") and getattr(nxt, "norm_sums_parts", False)]
        taking = [b for b in self.blocks if hasattr(b, "take_input_grad_parts")]
        writing = [(b, self.blocks[i - 1] if i > 0 and hasattr(self.blocks[i - 1], "output_grad_into") else None)
                   for i, b in enumerate(self.blocks) if hasattr(b, "norms_write_row_grads")]
        for block in handing:
            block.hand_output_parts(True)
        for block in taking:
            block.take_input_grad_parts(True)
        for block, previous in writing:
            block.norms_write_row_grads(True, previous, holding=bool(self.held))
        try:
            yield
        finally:
            for block in handing:
                block.hand_output_parts(False)
            for block in taking:
                block.take_input_grad_parts(False)
            for block, _ in writing:
                block.norms_write_row_grads(False)

    # ---- what the graphs run --------------------------------------------------------------------
    def _run_blocks(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        residual = None
        aliases = self._stack_grad_aliases()
        if self.dp_sync is None:
            hoisted = self.hoisted_casts is not None  # filled before the replay (_refresh_casts)
            casts = self.hoisted_casts if hoisted else self._pending_casts(x)
            for i, block in enumerate(self.blocks):
                if casts[i] is not None and not hoisted:
                    casts[i].fill()  # a no-op where the previous block's output projection issued it
                held = getattr(block, "held_work", None)
                if held is not None and i + 1 < len(casts) and casts[i + 1] is not None and not hoisted:
                    held.hold(casts[i + 1].fill)  # the next block's casts, in this block's waits
                with _giving(block, casts[i], aliases):
                    x, residual = block(x, residual)
                if held is not None:
                    held.run()  # what its output projection did not run (off the overlapped path)
            return x, residual
        for i, block in enumerate(self.blocks):  # each block waits for its weights' all-gather, then casts them
            self.dp_sync.before_block(i)
            with _giving(block, None, aliases):
                x, residual = block(x, residual)
        self.dp_sync.after_blocks()  # and the head, run eagerly after the replay, for its weights'
        return x, residual

    def _stack_grad_aliases(self) -> Optional[Dict[int, torch.Tensor]]:
        """One comm.tp_grad_aliases for every block's partial-gradient parameters when the blocks share
        one tp group: the captured backward then sums them all in one all-reduce, at its end, rather
        than one per block. None where each block makes its own."""
        groups = {id(getattr(b, "process_group", None)) for b in self.blocks}
        if not self.stack_scopes or len(groups) != 1 or not all(hasattr(b, "block_weights") for b in self.blocks):
            return None
        params = [p for b in self.blocks for p in b.tp_partial_grad_parameters()]
        return comm.tp_grad_aliases(params, self.blocks[0].process_group)

    def _pending_casts(self, x: torch.Tensor) -> List[Optional[weight_casts.PendingCast]]:
        """Each block's weight casts (weight_casts.prepare_cast: a few multi-tensor copy kernels instead of
        one small cast kernel per weight), not yet issued; all None where the blocks cast their own
        (selective recomputation) or nothing is cast. Block i+1's are issued in block i's output
        projection's forward, beside its reduce-scatter's last transfers (tpflash.parallel.held_work),
        rather than all at the start of the stack."""
        dtype = weight_casts.compute_dtype(x)
        if not self.stack_scopes or dtype is None or not all(hasattr(b, "block_weights") for b in self.blocks):
            return [None] * len(self.blocks)
        return [weight_casts.prepare_cast(b.weight_cast_groups(), dtype) for b in self.blocks]

    def _refresh_casts(self) -> None:
        """Cast the weights again (hoisted casts only) where they may have changed since the last cast:
        after any torch optimizer's step (a hook forgets the versions), or where an in-place write
        (a load, an unfused optimizer) moved a version counter."""
        if self.hoisted_casts is None:
            return
        versions = [t._version for cast in self.hoisted_casts if cast is not None for t in cast.tensors]
        if versions != self._cast_versions:
            for cast in self.hoisted_casts:
                if cast is not None:
                    cast.fill(again=True)
            self._cast_versions = versions

    def _main_grads(self) -> Optional[MainGrads]:
        """main_grad buffers for the blocks' fp32 weights, the weights each layer stacks side by side
        (the blocks' weight_cast_groups give the stacking), or None where there are none."""
        groups = [g for b in self.blocks if hasattr(b, "weight_cast_groups") for g in b.weight_cast_groups()]
        main = MainGrads(groups + [(p,) for p in self.params])
        return main if main.weights else None

    def _main_grads_open(self):
        return self.main_grads.open() if self.main_grads is not None else contextlib.nullcontext()

    def _forward(self) -> None:
        with self._main_grads_open():  # the layers take their weights' main_grad here (forward)
            self.outputs = self._run_blocks(self.static_x)

    def _backward(self) -> None:
        with self.dp_sync.gradient_hooks() if self.dp_sync is not None else contextlib.nullcontext():
            with holding_gradients(self.held), self._main_grads_open():
                self.input_grads = self._differentiate(self.outputs, self.static_grad_out)

    def _differentiate(self, outputs, grads) -> Tuple[Optional[torch.Tensor], ...]:
        """(d x, d each parameter) of the stack. Where the dp sync says not to collect the parameter
        gradients (fsdp=zero3: its hooks take them), the backward accumulates them into .grad, which
        its hooks empty as they go, so that one block's gradients are alive at a time, not the stack's."""
        if getattr(self.dp_sync, "collect_gradients", True):
            return torch.autograd.grad(outputs, (self.static_x,) + self.params, grads, allow_unused=True)
        self.static_x.grad = None
        torch.autograd.backward(outputs, grads, inputs=(self.static_x,) + self.params)
        return (self.static_x.grad,) + (None,) * len(self.params)

    def _warm_up(self) -> None:
        """A few eager passes on a side stream, so lazy set-up (autotuning, cuBLAS handles, NCCL
        communicators) happens before capture rather than inside it; the memory they cached is handed
        back to the device before the capture."""
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        device_type = self.static_x.device.type
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_ITERS):  # main_grad buffers take garbage here: start() resets them
                with autocast_for(device_type, self.autocast_state), self._main_grads_open():
                    outs = self._run_blocks(self.static_x)
                with autocast_for(device_type, NO_AUTOCAST), holding_gradients(self.held), self._main_grads_open():
                    self._differentiate(outs, [torch.ones_like(o) for o in outs])
            del outs
        torch.cuda.synchronize()
        # The passes' activations stay cached for the side stream, which runs nothing after them, while the
        # capture allocates its own in the graphs' pool: handed back, the stack's activations are held once
        # (llama-1b on one GPU: 40.0 to 26.9 GiB reserved at the same speed; docs/performance.md,
        # "Activation memory").
        torch.cuda.empty_cache()

    # ---- replay -----------------------------------------------------------------------------------
    def release(self) -> None:
        """Destroy the captured graphs now (their memory pool goes with the last of them). Call it before
        destroying the process groups whose collectives they captured; the object replays no more."""
        for graph in (getattr(self, "fwd_graph", None), getattr(self, "bwd_graph", None)):
            if graph is not None:
                graph.release()
        self.fwd_graph = self.bwd_graph = None
        if getattr(self, "_step_hook", None) is not None:
            self._step_hook.remove()
            self._step_hook = None

    def matches(self, x: torch.Tensor) -> bool:
        """Whether a replay computes what the eager blocks would for this input, here and now."""
        return (torch.is_grad_enabled() and (tuple(x.shape), x.dtype, x.device) == self.key
                and autocast_state(x.device.type) == self.autocast_state and self.blocks[0].training == self.training)

    def __call__(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.matches(x):
            raise ValueError(f"input {tuple(x.shape)} {x.dtype} (grad mode, autocast, training) does not match "
                             f"the capture's {self.key}; check matches() first")
        # The forward graph is launched before the autograd node over every parameter is built: that
        # node costs the host about 0.5 ms (388 inputs for gpt-1.3b), which the GPU then spends running
        # the graph instead of waiting for it at the start of the step.
        with torch.no_grad():
            generation = self.replay_forward(x)
        return _ReplayBlocks.apply(self, generation, x, *self.params)

    def replay_forward(self, x: torch.Tensor) -> int:
        if x.data_ptr() != self.static_x.data_ptr():
            self.static_x.copy_(x)
        self._unalias_accumulated_grads()
        self._refresh_casts()
        self.fwd_graph.replay()
        self.forward_generation += 1
        return self.forward_generation

    def replay_backward(self, generation: int, grads: Sequence[Optional[torch.Tensor]]):
        if generation != self.forward_generation or self.backward_generation == generation:
            raise RuntimeError("backward through CUDA-graphed blocks out of order: the blocks ran forward again "
                               "(or this backward already ran) since the forward this gradient belongs to; "
                               "graphed blocks need one backward per forward, in order")
        self.backward_generation = generation
        for static, grad in zip(self.static_grad_out, grads):
            if grad is None:
                static.zero_()
            elif grad.data_ptr() != static.data_ptr():
                static.copy_(grad)
        if self.main_grads is not None:  # each weight's .grad is its main_grad, holding what .grad held
            self.main_grads.start()
        self.bwd_graph.replay()
        if self.dp_sync is not None:
            self.dp_sync.backward_replayed()
        x_grad, param_grads = self.input_grads[0], self.input_grads[1:]
        return (None if x_grad is None else x_grad.detach(),) + tuple(
            g.detach() if g is not None and returned else None for g, returned in zip(param_grads, self.returned))

    def before_eager_run(self) -> None:
        """Called before the blocks run eagerly instead of replaying: the parameters must hold their
        updated values (dp_sync may still be gathering them on a side stream)."""
        if self.dp_sync is not None:
            self.dp_sync.wait_all()

    def _unalias_accumulated_grads(self) -> None:
        # autograd keeps a returned gradient as param.grad when there was none: that .grad is then
        # the backward graph's output buffer, in the pool the graphs share, and the next forward
        # replay may already write its temporaries there (the captures reused freed blocks). To
        # accumulate (a second forward and backward before zero_grad), such a .grad is moved out
        # first: one copy of those gradients per extra micro-batch, none without accumulation.
        for p, g, returned in zip(self.params, self.input_grads[1:], self.returned):
            if returned and p.grad is not None and g is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()


def _giving(block: nn.Module, casts: Optional[weight_casts.PendingCast], aliases: Optional[Dict[int, torch.Tensor]]):
    """The block's layers take these casts and tp-gradient aliases in its forward (BlockWeights.use), where
    it has any; a None is left for the block to make."""
    if not hasattr(block, "block_weights"):
        return contextlib.nullcontext()
    return block.block_weights.use(casts, aliases)


def _cast_again_after_optimizer_steps(graphed: GraphedBlocks):
    """A hook after every torch optimizer's step that makes `graphed` cast its weights again before its
    next forward (a weak reference: the hook does not keep it alive, and goes with it)."""
    ref = weakref.ref(graphed)

    def forget_versions(optimizer, args, kwargs) -> None:
        me = ref()
        if me is not None:
            me._cast_versions = None

    handle = register_optimizer_step_post_hook(forget_versions)
    weakref.finalize(graphed, handle.remove)
    return handle


class _ReplayBlocks(torch.autograd.Function):
    """The graphed stack as one autograd node over a forward replay already launched: inputs x and every
    parameter, outputs (out, residual); its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, graphed: GraphedBlocks, generation: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.graphed, ctx.generation = graphed, generation  # the replay ran already (GraphedBlocks.__call__)
        return tuple(o.detach() for o in graphed.outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, None) + ctx.graphed.replay_backward(ctx.generation, grads)
