"""The optimizer's update deferred into the next forward replay (GPT.capture_cuda_graphs(optimizer=),
tpflash.layers.deferred_updates) trains exactly as the optimizer's own step: the same losses step
after step and, once applied, the same weights and AdamW state; the state read, loaded or run
eagerly in between sees the update applied. On CPU the graphs are the eager stand-in over gloo
(bit for bit: both twins overlap, so the same sums in the same order); the gpu test captures them."""

import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tpflash.layers.deferred_updates import DeferredUpdates
from tpflash.models import GPT, GPTConfig
from tpflash.parallel import overlap
from tpflash.train.gradients import clipped_step, global_grad_norm

VOCAB, SEQ, BATCH = 101, 8, 2


def twins(device, n_layer=3):
    cfg = GPTConfig.preset("gpt2-tiny", vocab_size=VOCAB, block_size=16, n_layer=n_layer, n_embd=32, n_head=4,
                           ffn_hidden=64, sequence_parallel=True)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg, device=device))
    return models


def batch(seed, device):
    g = torch.Generator().manual_seed(seed)  # the same tokens on every rank
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx.to(device), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)


def amp(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def adamw(model):
    """Decay on the matrices only (two param groups), as the trainer's; lr moved by a schedule."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def step_both(models, opts, scheds, step, device, ps):
    """One training step of each model (loss, clipped by the global norm through AdamW's grad_scale, as
    the trainer does): their losses."""
    losses = []
    for model, opt, sched in zip(models, opts, scheds):
        idx, targets = batch(step, device)
        with amp(device):
            loss = model(idx, targets)
        loss.backward()
        norm = global_grad_norm(model, ps.tp_group, None, False)
        clipped_step(opt, model.parameters(), norm, 0.05)
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())
    return losses


def train_body(tp, steps=4):
    ps = init_tp(tp)
    device = ps.device
    models = twins(device)
    opts, scheds = zip(*(adamw(m) for m in models))
    for m in models:
        overlap.set_overlap(m, True)  # both overlap: the same sums in the same order
    with amp(device):
        models[0].capture_cuda_graphs(BATCH, SEQ, optimizer=opts[0])
        models[1].capture_cuda_graphs(BATCH, SEQ)
    updates = models[0]._graphed_blocks.updates
    assert updates is not None, "no update was deferred"
    assert len(updates.weights) == 6 * len(models[0].blocks), f"{len(updates.weights)} weights deferred"
    tol = 2e-2 if device.type == "cuda" else 0.0
    for step in range(steps):
        losses = step_both(models, opts, scheds, step, device, ps)
        assert updates.pending, "the step did not leave an update for the next forward"
        assert_close(losses[0], losses[1], f"step {step}: loss", tol=tol)
    models[0].apply_deferred_updates()
    assert not updates.pending
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert_close(p, q, f"{name} after {steps} steps", tol=tol)
    for (p, q) in zip(models[0].parameters(), models[1].parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_close(opts[0].state[p][key], opts[1].state[q][key], f"AdamW {key}", tol=tol)


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("tp", [2, 4])
def test_updates_deferred_into_the_next_forward_train_like_the_optimizers_own_step(ranks, tp):
    ranks(tp).run(train_body, tp)


def reads_body(tp):
    """After a step: the optimizer's state_dict, an eager forward, and a load of saved state all see the
    deferred update applied, as the optimizer's own step would leave them."""
    ps = init_tp(tp)
    device = ps.device
    models = twins(device)
    opts, scheds = zip(*(adamw(m) for m in models))
    for m in models:
        overlap.set_overlap(m, True)
    with amp(device):
        models[0].capture_cuda_graphs(BATCH, SEQ, optimizer=opts[0])
        models[1].capture_cuda_graphs(BATCH, SEQ)
    step_both(models, opts, scheds, 0, device, ps)
    saved = [opt.state_dict() for opt in opts]  # the hook applies the pending update first
    for (p, q) in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q), "state_dict() did not apply the pending update"
    step_both(models, opts, scheds, 1, device, ps)
    idx, _ = batch(7, device)
    with torch.no_grad():  # an eager forward: the pending update first
        outs = [m(idx) for m in models]
    assert torch.equal(outs[0], outs[1]), "the eager forward ran before the pending update"
    # back to the first step's state: the loaded values go into the tensors the graph updates
    for model, opt, state in zip(models, opts, saved):
        opt.load_state_dict(state)
    updates = models[0]._graphed_blocks.updates
    assert not updates.pending, "a load kept an update of the replaced state pending"
    w = updates.weights[0]
    assert opts[0].state[w]["exp_avg"] is updates.buckets[0][0][0][3][0] or any(
        opts[0].state[w]["exp_avg"] is t for block in updates.buckets for part in block for b in part for t in b[3]), \
        "the optimizer's state no longer holds the tensors the graph updates"
    losses = step_both(models, opts, scheds, 2, device, ps)
    assert torch.equal(losses[0], losses[1])
    models[0].apply_deferred_updates()
    for (p, q) in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q), "training after a load diverged"


@pytest.mark.cpu_ranks
def test_reading_or_loading_the_state_between_steps_sees_the_deferred_update_applied(ranks):
    ranks(2).run(reads_body, 2)


def test_a_deferred_update_is_applied_once_and_only_where_a_step_left_one():
    w = torch.nn.Parameter(torch.randn(4, 3))
    buffer = torch.randn(4, 3)
    twin = torch.nn.Parameter(w.detach().clone())
    opt = torch.optim.AdamW([w], lr=1e-2, fused=True)
    ref = torch.optim.AdamW([twin], lr=1e-2, fused=True)
    updates = DeferredUpdates(opt, [[[w]]], {id(w): buffer})
    before = w.detach().clone()
    updates.issue(0, 0)  # nothing pending: nothing changes
    assert torch.equal(w, before) and float(opt.state[w]["step"]) == 0
    w.grad, twin.grad = buffer, buffer.clone()
    opt.step()
    assert torch.equal(w, before), "the optimizer's own step updated a deferred weight"
    assert w.grad is buffer, "the step did not give the gradient back"
    ref.step()
    opt.step()  # a second step before any forward: the first one's update is applied first
    ref.step()
    updates.issue(0, 0)
    updates.replayed()
    updates.issue(0, 0)  # a second replay: nothing pending
    assert torch.equal(w, twin) and float(opt.state[w]["step"]) == 2
    updates.remove()
    opt.step()  # removed: the optimizer updates the weight itself again
    ref.step()
    assert torch.equal(w, twin)


def test_deferred_updates_reject_what_they_would_compute_differently():
    w = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="AdamW"):
        DeferredUpdates(torch.optim.SGD([w], lr=0.1), [[[w]]], {id(w): torch.zeros(4, 3)})
    with pytest.raises(ValueError, match="amsgrad"):
        DeferredUpdates(torch.optim.AdamW([w], amsgrad=True), [[[w]]], {id(w): torch.zeros(4, 3)})
    opt = torch.optim.AdamW([w], lr=1e-2)
    DeferredUpdates(opt, [[[w]]], {id(w): torch.zeros(4, 3)})
    opt.param_groups[0]["weight_decay"] = 0.5
    w.grad = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="weight_decay"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_cuda_graphs_with_updates_deferred_into_the_forward_train_like_the_optimizers_own_step(ranks, tp):
    """The CPU twin: test_updates_deferred_into_the_next_forward_train_like_the_optimizers_own_step; here
    the update is captured in the forward graph, in the copy engines' waits, over NCCL."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(train_body, tp)


def test_updates_deferred_on_one_rank_train_like_the_optimizers_own_step():
    """tp=1: the layers' own autograd Function (tpflash.layers.autocast_linear) writes the gradients."""
    train_body(1)
