"""fsdp=zero1 on the ranks' own device: over NCCL where the GPUs are visible (gloo on CPU otherwise)."""
import contextlib

import pytest
import torch

from tests.checkpoint.tiny_model import build, make_optimizer
from tests.distributed.checks import assert_close, init_tp
from tests.distributed.test_zero import _ddp_step, _train, _zero1_step
from tpflash.parallel import ShardedOptimizerState, replicate_over_dp


def device_body(tp):
    """The same comparison on the ranks' own device: over NCCL where GPUs are visible, whose in-place
    reduce-scatter and all-gather (output inside the input) this checks."""
    ps = init_tp(tp)
    model, reference = build(seed=0).to(ps.device), build(seed=0).to(ps.device)
    zero = ShardedOptimizerState(model, ps)
    ddp = replicate_over_dp(reference, ps)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    norms = _train(_zero1_step, model, model, zero, optimizer, ps, ps.dp_rank, ps.dp_size, steps=5)
    ref_norms = _train(_ddp_step, ddp, reference, ddp, ref_optimizer, ps, ps.dp_rank, ps.dp_size, steps=5)
    tol = 1e-5 if ps.device.type == "cpu" else 1e-4  # NCCL sums in another order than its all-reduce
    assert_close(torch.tensor(norms), torch.tensor(ref_norms), "grad-norm curve", tol=tol)
    for name, p in model.named_parameters():
        assert_close(p, dict(reference.named_parameters())[name], name, tol=tol)


# dp=2 on 2 ranks and tp=2 x dp=2 on 4: over NCCL wherever that many GPUs are visible (gloo on CPU);
# dp=4 on 4 GPUs only (dp2 is its CPU twin)
LAYOUTS = pytest.mark.parametrize("world,tp", [(2, 1), (4, 2), pytest.param(4, 1, marks=pytest.mark.gpu)],
                                  ids=["dp2", "dp2-tp2", "dp4"])


@LAYOUTS
def test_zero1_trains_like_ddp_on_the_ranks_device(ranks, world, tp):
    ranks(world).run(device_body, tp)


def graphed_gpt_body(tp, in_graph):
    """A GPT whose blocks replay captured graphs (real ones on GPUs, NCCL and the copy engines inside),
    under zero1, against the same GPT eager under DDP: the captured backward's gradients must land in
    the flat buffers and the replays must read the gathered weights. `in_graph`: the graphs also
    reduce-scatter the blocks' gradients and wait for their weights' all-gather (one micro-batch per
    step); else two micro-batches accumulate and zero1 reduces after the backward."""
    from tests.distributed.test_graphed_blocks import BATCH, SEQ, amp, batch, config, twins
    ps = init_tp(tp)
    device = ps.device
    # an untied head: its own buckets, reduced first in the captured backward and gathered last
    graphed, eager = twins(config(sequence_parallel=tp > 1, tie_embeddings=False), device)
    zero = ShardedOptimizerState(graphed, ps)  # before the capture: the graphs keep the flat buffers' addresses
    sync = zero.sync_in_graphs(graphed.blocks) if in_graph else None
    with amp(device):
        graphed.capture_cuda_graphs(BATCH, SEQ, dp_sync=sync)
    if sync is not None:
        zero.use_graph_sync(sync)
    ddp = replicate_over_dp(eager, ps)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (graphed, eager)]
    tol = 2e-2 if device.type == "cuda" else 1e-5
    micro_batches = 1 if in_graph else 2
    for step in range(3):
        losses = []
        for forward, opt in zip((graphed, ddp), opts):
            for micro in range(micro_batches):  # dp rank d: micro-batches d * n ... d * n + n - 1 of the step's
                idx, targets = batch(100 * step + micro_batches * ps.dp_rank + micro, device)
                with amp(device):
                    loss = forward(idx, targets) / micro_batches
                with ddp.no_sync() if forward is ddp and micro < micro_batches - 1 else contextlib.nullcontext():
                    loss.backward()
                losses.append(loss.detach().float())
            if forward is graphed:
                zero.reduce_gradients()
                zero.step(opt.step)
                zero.zero_grad()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert_close(sum(losses[:micro_batches]), sum(losses[micro_batches:]), f"step {step}: loss", tol=tol)
    assert graphed._graphed_blocks.forward_generation == 3 * micro_batches, "the replays did not run"
    zero.wait_for_parameters()
    for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
        if name.endswith("k_proj.bias"):  # its exact gradient is 0 (softmax ignores a shift of every key):
            continue  # AdamW turns rounding noise into full-size steps, different in any other summation order
        assert_close(p, q, f"{name} after 3 steps", tol=tol)


@LAYOUTS
@pytest.mark.parametrize("in_graph", [False, True], ids=["reduced-after", "reduced-in-graph"])
def test_a_graphed_gpt_under_zero1_trains_like_the_eager_gpt_under_ddp(ranks, world, tp, in_graph):
    ranks(world).run(graphed_gpt_body, tp, in_graph)


def second_backward_body():
    from tests.distributed.test_graphed_blocks import BATCH, SEQ, amp, batch, config, twins
    ps = init_tp(1)
    model, _ = twins(config(sequence_parallel=False), ps.device)
    zero = ShardedOptimizerState(model, ps)
    sync = zero.sync_in_graphs(model.blocks)
    with amp(ps.device):
        model.capture_cuda_graphs(BATCH, SEQ, dp_sync=sync)
    zero.use_graph_sync(sync)
    for _ in range(2):
        idx, targets = batch(0, ps.device)
        with amp(ps.device):
            loss = model(idx, targets)
        try:
            loss.backward()
        except RuntimeError as e:
            assert "one backward per optimizer step (grad_accum=1)" in str(e), e
            return
    raise AssertionError("a second backward before zero_grad did not raise")


def test_reduction_in_the_graphs_refuses_a_second_backward_before_zero_grad(ranks):
    ranks(2).run(second_backward_body)
