"""replicate_over_dp: DDP over dp composed with tp trains like one process, reducing buckets during the backward."""
import contextlib

import pytest
import torch

from tests.checkpoint.tiny_model import build, full_state, make_optimizer, train
from tests.distributed.checks import assert_close, init_layout, init_tp
from tests.models.reference import assert_grad_close
from tpflash.parallel import replicate_over_dp

pytestmark = pytest.mark.cpu_ranks  # the tiny models live on CPU: gloo even where GPUs are visible

STEPS = 3


def training_body(tp):
    ps = init_tp(tp)
    model = build(seed=0)
    ddp = replicate_over_dp(model, ps)
    reference = build(seed=0, tp=False)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    train(ddp, optimizer, range(STEPS), ps.dp_rank, ps.dp_size)  # each dp rank: its rows of each batch
    train(reference, ref_optimizer, range(STEPS))  # the whole batch in one process
    got, expected = full_state(model, optimizer), full_state(reference, ref_optimizer)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(got[key], value, key, tol=1e-5)


@pytest.mark.parametrize("tp", [1, 2], ids=["dp4", "dp2-tp2"])
def test_replicated_training_equals_single_process_training(ranks, tp):
    ranks(4).run(training_body, tp)


def cp_average_body():
    """Each of the dp * cp ranks feeds its own data; every rank ends with the mean of all their gradients."""
    ps = init_layout(1, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    ddp = replicate_over_dp(model, ps)
    assert ddp.process_group is ps.dp_cp_group and ps.dp_cp_size == 4
    data = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    ddp(data[ps.dp_cp_rank]).square().sum().backward()
    for x in data:  # the single-process reference: the same losses, each weighted 1/4
        (reference(x).square().sum() / 4).backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, ref.grad, f"grad of {name}", tol=1e-6)


def test_ddp_averages_gradients_over_dp_times_cp_ranks(ranks):
    ranks(4).run(cp_average_body)


def overlap_body():
    """Counts the parameter gradients accumulated when each bucket's all-reduce is launched."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    ps = init_tp(1)
    model = build(seed=0)
    ddp = replicate_over_dp(model, ps, bucket_cap_mb=0.001)  # ~1 KB buckets: several for the tiny model
    accumulated, seen_at_launch = [0], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: accumulated.__setitem__(0, accumulated[0] + 1))

    def recording_hook(group, bucket):
        seen_at_launch.append(accumulated[0])
        return allreduce_hook(group, bucket)

    ddp.register_comm_hook(ps.dp_group, recording_hook)
    optimizer = make_optimizer(model)
    for step in range(2):  # DDP fixes its buckets by the gradients' order after the first backward
        accumulated[0], seen_at_launch[:] = 0, []
        train(ddp, optimizer, range(step, step + 1), ps.dp_rank, ps.dp_size)
    n_params = len(list(model.parameters()))
    assert len(seen_at_launch) > 1, seen_at_launch
    assert seen_at_launch[0] < n_params, f"first bucket launched after all {n_params} gradients: {seen_at_launch}"


def test_buckets_are_all_reduced_while_the_backward_still_runs(ranks):
    ranks(2).run(overlap_body)


def graphed_body(steps=3, micro_batches=2):
    """The GPT with graphed blocks (CUDA graphs on GPU, their eager stand-in on CPU) under DDP, with
    gradient accumulation (no_sync), against the eager GPT fed every dp rank's rows in one process."""
    from tests.distributed.test_graphed_blocks import BATCH, SEQ, amp, batch, config, twins
    ps = init_tp(1)
    device = ps.device if torch.cuda.is_available() else torch.device("cpu")
    graphed, reference = twins(config(False), device)
    with amp(device):
        graphed.capture_cuda_graphs(BATCH, SEQ)
    ddp = replicate_over_dp(graphed, ps)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (graphed, reference)]
    tol = 2e-2 if device.type == "cuda" else 1e-5
    rows = slice(ps.dp_rank * BATCH, (ps.dp_rank + 1) * BATCH)
    for step in range(steps):
        for mb in range(micro_batches):
            idx, targets = batch(10 * step + mb, device, batch_size=BATCH * ps.dp_size)  # the global micro-batch
            sync = contextlib.nullcontext() if mb == micro_batches - 1 else ddp.no_sync()
            with sync:
                with amp(device):
                    loss = ddp(idx[rows], targets[rows])
                (loss / micro_batches).backward()
            with amp(device):
                ref_loss = reference(idx, targets)
            (ref_loss / micro_batches).backward()
        for (name, p), ref in zip(graphed.named_parameters(), reference.parameters()):
            assert_grad_close(p.grad, ref.grad, f"step {step}: grad of {name}", tol=tol)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert graphed._graphed_blocks.forward_generation == steps * micro_batches, "the replays did not run"


@pytest.mark.parametrize("world", [2, 4], ids=["dp2", "dp4"])
def test_graphed_blocks_under_ddp_train_like_one_eager_process(ranks, world):
    ranks(world).run(graphed_body)


@pytest.mark.gpu
def test_cuda_graphed_blocks_under_ddp_train_like_the_eager_gpt_on_one_gpu():
    # one GPU: DDP over a world of 1 still runs its reducer (bucket views filled from the graphs'
    # gradient buffers, no_sync accumulation, zero_grad to None), which is what can differ on CUDA
    graphed_body()


def test_a_bucket_size_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="bucket_cap_mb=0 must be > 0"):
        replicate_over_dp(torch.nn.Linear(2, 2), ps=None, bucket_cap_mb=0)
