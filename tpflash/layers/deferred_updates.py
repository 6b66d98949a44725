"""AdamW's update of the blocks' weight matrices, issued in the waits of the next forward's CUDA graph.

Under the overlapped tensor-parallel layers a block's forward waits on the copy engines around its
attention's narrow projections (the q/k/v gather, the output projection's reduce-scatter: docs/
performance.md, "TP efficiency"), while the optimizer's update of the same weights runs after the
backward with the GPU to itself. AdamW is elementwise over each parameter, so block i's update may
run any time between the backward that made its gradient and the forward that reads its weights.
`DeferredUpdates` takes the update of the weights whose gradients the blocks' GEMMs add into their
main_grad buffers (tpflash.layers.main_grads) out of `optimizer.step()`, and GraphedBlocks issues it
inside its forward graph (`issue`): block i+1's MLP weights in block i's q/k/v gather, its attention
weights in block i's output projection, before block i+1's weights are cast; block 0's first.

It computes what the optimizer computes: torch's fused AdamW kernel (`torch._fused_adamw_`) on the
optimizer's own state tensors, with the lr and the clip scale (`optimizer.grad_scale`, see
tpflash.train.gradients.clipped_step) of the step() that deferred it. The graph issues the update in
every replay; a device flag, passed as AdamW's `found_inf` (which makes the kernel leave parameters,
moments and steps as they are), says whether one is pending. Whatever reads the weights or the
optimizer's state outside the next forward replay calls `flush()` first: GraphedBlocks before an
eager forward, the trainer before evaluation, samples and checkpoints, and `optimizer.state_dict()`
through a hook.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

_HYPER = ("betas", "eps", "weight_decay")


def _set(t: torch.Tensor, value) -> None:
    """t = value (a number or a tensor), on t's device without a host sync."""
    if isinstance(value, torch.Tensor):
        t.copy_(value)
    else:
        t.fill_(value)


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ValueError(f"deferred updates need a torch.optim.AdamW (or a subclass), got {type(optimizer).__name__}")
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                raise ValueError(f"deferred updates do not support AdamW's {flag}=True (param group {i})")


class DeferredUpdates:
    """The AdamW update of `parts[i][j]` (block i's weights, in the part of its forward that issues them:
    GraphedBlocks), taken out of `optimizer.step()` and issued by `issue(i, j)`. Weights of one part may
    sit in several param groups. The weights must be fp32, each with `.main_grad`-style gradient
    buffers given in `grads` (id(weight) -> buffer) that keep their values until the next forward."""

    def __init__(self, optimizer: torch.optim.AdamW, parts: Sequence[Sequence[Sequence[torch.nn.Parameter]]],
                 grads: Dict[int, torch.Tensor]):
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        weights = [w for block in parts for part in block for w in part]
        if not weights:
            raise ValueError("deferred updates: no weights given")
        device = weights[0].device
        # on CUDA the fused kernel reads a tensor lr as fp32; on CPU fp64 keeps the bits of a float lr
        lr_dtype = torch.float32 if device.type == "cuda" else torch.float64
        self.lrs = [torch.zeros((), dtype=lr_dtype, device=device) for _ in optimizer.param_groups]
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self.skip = torch.ones((), dtype=torch.float32, device=device)  # 1: nothing pending (AdamW's found_inf)
        self.hyper = [tuple(group[k] for k in _HYPER) for group in optimizer.param_groups]
        self.weights = [w for w in weights if id(w) in group_of]
        self.grads = grads
        # per block and part: (param group, params, grads, exp_avgs, exp_avg_sqs, steps)
        self.buckets: List[List[List[Tuple]]] = []
        for block in parts:
            self.buckets.append([self._buckets([w for w in part if id(w) in group_of], group_of) for part in block])
        self.pending = False
        self.backward_since_step = False  # the GEMMs write the gradients: one backward per step
        self._hidden: List[torch.Tensor] = []
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step),
                       optimizer.register_state_dict_pre_hook(lambda opt: self.flush()),
                       optimizer.register_load_state_dict_post_hook(self._after_load)]

    def _buckets(self, part: List[torch.nn.Parameter], group_of: Dict[int, int]) -> List[Tuple]:
        by_group: Dict[int, List[torch.nn.Parameter]] = {}
        for w in part:
            by_group.setdefault(group_of[id(w)], []).append(w)
        buckets = []
        for g, params in sorted(by_group.items()):
            states = [self._state(p) for p in params]
            buckets.append((g, params, [self.grads[id(p)] for p in params], [s["exp_avg"] for s in states],
                            [s["exp_avg_sq"] for s in states], [s["step"] for s in states]))
        return buckets

    def _state(self, p: torch.nn.Parameter) -> dict:
        """p's AdamW state as the fused kernel reads it (made now if the optimizer has none yet: what
        AdamW's first step would make), its step a device tensor."""
        state = self.optimizer.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        return state

    # ---- the update ------------------------------------------------------------------------------------
    def issue(self, block: int, part: int) -> None:
        """Issue the update of block `block`'s weights of part `part` on the current stream: applied where
        one is pending when the kernels run, else nothing changes."""
        for g, params, grads, exp_avgs, exp_avg_sqs, steps in self.buckets[block][part]:
            beta1, beta2 = self.hyper[g][0]
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=self.lrs[g], beta1=beta1,
                                beta2=beta2, weight_decay=self.hyper[g][2], eps=self.hyper[g][1], amsgrad=False,
                                maximize=False, grad_scale=self.grad_scale, found_inf=self.skip)
            torch._foreach_sub_(steps, [self.skip] * len(steps))

    def backward_replayed(self) -> None:
        """Before a backward replay: raises RuntimeError where one ran since the last step (its gradients,
        which this one's GEMMs would overwrite rather than add to, were never stepped on)."""
        if self.backward_since_step:
            raise RuntimeError("a second backward before optimizer.step(): with the optimizer's update deferred "
                               "into the forward graph (capture_cuda_graphs(optimizer=)) the graphs run one "
                               "backward per step; for micro-batches capture with accumulate_grads=True instead")
        self.backward_since_step = True

    def replayed(self) -> None:
        """After a forward replay that issued every update: nothing is pending any more."""
        if self.pending:
            self.skip.fill_(1.0)
            self.pending = False

    def flush(self) -> None:
        """Apply a pending update now (eagerly, on the current stream)."""
        if not self.pending:
            return
        with torch.no_grad():
            for block in range(len(self.buckets)):
                for part in range(len(self.buckets[block])):
                    self.issue(block, part)
        self.replayed()

    # ---- the optimizer's hooks -------------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs) -> None:
        self.flush()  # a second step before any forward: the first one's update first
        for g, group in enumerate(optimizer.param_groups):
            if tuple(group[k] for k in _HYPER) != self.hyper[g]:
                raise ValueError(f"param group {g}'s {', '.join(_HYPER)} changed after the CUDA graphs were captured "
                                 f"with deferred updates ({self.hyper[g]} -> {tuple(group[k] for k in _HYPER)}): "
                                 "capture them again")
        self._hidden = [w.grad for w in self.weights]
        for w in self.weights:  # the step leaves them alone: the next forward replay updates them
            w.grad = None

    def _after_step(self, optimizer, args, kwargs) -> None:
        for w, grad in zip(self.weights, self._hidden):
            w.grad = grad
        self._hidden = []
        for lr, group in zip(self.lrs, optimizer.param_groups):  # the lr of this step (a scheduler moves it after)
            _set(lr, group["lr"])
        _set(self.grad_scale, getattr(optimizer, "grad_scale", 1.0))  # the clip scale (clipped_step)
        _set(self.skip, getattr(optimizer, "found_inf", 0.0))  # a GradScaler's verdict, else apply
        self.pending = True
        self.backward_since_step = False

    def _after_load(self, optimizer) -> None:
        """load_state_dict made new state tensors: their values go into the ones the graph updates, which
        the optimizer's state holds again. A pending update is dropped (the state was replaced)."""
        for block in self.buckets:
            for part in block:
                for _, params, _, exp_avgs, exp_avg_sqs, steps in part:
                    for p, exp_avg, exp_avg_sq, step in zip(params, exp_avgs, exp_avg_sqs, steps):
                        state = optimizer.state[p]
                        for key, ours in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("step", step)):
                            if key not in state:
                                ours.zero_()  # no state saved for p: as before its first step
                            elif state[key] is not ours:
                                ours.copy_(state[key])
                            state[key] = ours
        self.pending = False
        self.skip.fill_(1.0)

    def remove(self) -> None:
        """Apply what is pending and hand the weights back to optimizer.step()."""
        self.flush()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


MLP, ATTENTION = 0, 1  # the parts of a block's weights, in the order its forward reaches their slots


def for_blocks(optimizer: torch.optim.Optimizer, blocks: Sequence[torch.nn.Module],
               weights: Sequence[torch.nn.Parameter], buffers: Sequence[torch.Tensor]) -> Optional[DeferredUpdates]:
    """DeferredUpdates for the blocks' `weights` whose gradients the GEMMs add into `buffers` (their
    main_grads, tpflash.layers.main_grads) and that the optimizer updates, split per block into its
    MLP's and the rest; None where there are none, where the optimizer is not the fused AdamW (whose
    kernel the graph issues: another one would compute other bits), or where a block has no output
    projection to run held work (`held_work`)."""
    _check_optimizer(optimizer)
    if not all(group.get("fused") for group in optimizer.param_groups):
        return None
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    deferred = {id(w): b for w, b in zip(weights, buffers) if id(w) in in_optimizer}
    if not deferred or not all(getattr(b, "held_work", None) is not None for b in blocks):
        return None
    parts = []
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        mlp_ids = {id(p) for p in mlp.parameters()} if mlp is not None else set()
        mine = [p for p in block.parameters() if id(p) in deferred]
        parts.append([[p for p in mine if id(p) in mlp_ids], [p for p in mine if id(p) not in mlp_ids]])
    return DeferredUpdates(optimizer, parts, deferred)


def hold_for_next_block(updates: DeferredUpdates, block: torch.nn.Module, next_index: int) -> None:
    """Hand block's forward waits the update of block `next_index`: its MLP weights' to the q/k/v gather
    (`qkv_held_work`, where the block has one), its other weights' to the output projection (`held_work`),
    which first runs whatever the q/k/v projection left (off the overlapped path), so that every update
    precedes the next block's weight casts held after it."""
    qkv_held = getattr(block, "qkv_held_work", None)
    if qkv_held is not None:
        qkv_held.hold(lambda: updates.issue(next_index, MLP))
        block.held_work.hold(qkv_held.run)
    else:
        block.held_work.hold(lambda: updates.issue(next_index, MLP))
    block.held_work.hold(lambda: updates.issue(next_index, ATTENTION))
