"""LocalShardAdamW: torch's AdamW run on the local shards of DTensor parameters gives torch's AdamW's
parameters and state bit for bit (FSDP2's shards on gloo ranks, and plain tensors), with the moments
kept as DTensors for checkpoints."""
import pytest
import torch
import torch.nn as nn

from tests.distributed.checks import init_tp
from tpflash.parallel import LocalShardAdamW, apply_fsdp

pytestmark = pytest.mark.cpu_ranks

STEPS = 3


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _groups(model):
    """Weight decay on matrices only, as the trainer's optimizer."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _train(model, optimizer, rank, grad_scale=None):
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(5, 8)).square().sum().backward()
        if grad_scale is not None:
            optimizer.grad_scale = torch.tensor(grad_scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _assert_same_bits(a_model, a_opt, b_model, b_opt):
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters()):
        assert torch.equal(_local(p), _local(q)), f"{name}"
        for key in ("exp_avg", "exp_avg_sq", "step"):
            x, y = a_opt.state[p][key], b_opt.state[q][key]
            assert type(x) is type(y), f"{name} {key}: {type(x).__name__} against torch's {type(y).__name__}"
            assert torch.equal(_local(x), _local(y)), f"{name} {key}"


def fsdp_body(mode):
    ps = init_tp(1)
    kwargs = {"fused": True} if mode == "fused" else {"foreach": mode == "foreach"}
    ours, theirs = apply_fsdp(_model(), ps), apply_fsdp(_model(), ps)
    assert any(hasattr(p, "device_mesh") for p in ours.parameters()), "FSDP2 gave no DTensor parameters"
    ours_opt = LocalShardAdamW(_groups(ours), lr=1e-2, **kwargs)
    theirs_opt = torch.optim.AdamW(_groups(theirs), lr=1e-2, **kwargs)
    _train(ours, ours_opt, ps.rank)
    _train(theirs, theirs_opt, ps.rank)
    _assert_same_bits(ours, ours_opt, theirs, theirs_opt)


@pytest.mark.parametrize("mode", ["fused", "foreach", "single"])
def test_it_updates_fsdp2_shards_as_torchs_adamw_does(ranks, mode):
    ranks(2).run(fsdp_body, mode)


@pytest.mark.parametrize("grad_scale", [None, 4.0], ids=["plain", "grad_scale"])
def test_it_updates_plain_parameters_as_torchs_adamw_does(grad_scale):
    ours, theirs = _model(), _model()
    ours_opt = LocalShardAdamW(_groups(ours), lr=1e-2, fused=True)
    theirs_opt = torch.optim.AdamW(_groups(theirs), lr=1e-2, fused=True)
    _train(ours, ours_opt, 0, grad_scale)
    _train(theirs, theirs_opt, 0, grad_scale)
    _assert_same_bits(ours, ours_opt, theirs, theirs_opt)


def _twin_shards_with_gradients(ps):
    """Two equal FSDP2 models with fused LocalShardAdamW optimizers, after one backward of the same batch:
    ((model, optimizer), (model, optimizer))."""
    twins = [apply_fsdp(_model(), ps) for _ in range(2)]
    torch.manual_seed(ps.rank)
    x = torch.randn(5, 8)
    for model in twins:
        model(x).square().sum().backward()
    return [(model, LocalShardAdamW(_groups(model), lr=1e-2, fused=True)) for model in twins]


def _assert_same_parameters(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(_local(p), _local(q), rtol=1e-6, atol=1e-7)


def grad_scale_body():
    """A fused step handed `grad_scale` divides each shard's gradient by it, as clipping asks of it."""
    (scaled, scaled_opt), (divided, divided_opt) = _twin_shards_with_gradients(init_tp(1))
    for p in divided.parameters():
        p.grad.div_(4.0)
    scaled_opt.grad_scale = torch.tensor(4.0)
    scaled_opt.step()
    divided_opt.step()
    _assert_same_parameters(scaled, divided)


def test_a_fused_step_with_grad_scale_divides_the_shards_gradients(ranks):
    ranks(2).run(grad_scale_body)


def state_dict_body():
    ps = init_tp(1)
    model = apply_fsdp(_model(), ps)
    optimizer = LocalShardAdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, ps.rank)
    moments = [v for state in optimizer.state_dict()["state"].values() for k, v in state.items() if k != "step"]
    return [type(m).__name__ for m in moments]


def test_its_moments_stay_dtensors_for_checkpoints(ranks):
    for names in ranks(2).run(state_dict_body):
        assert names and set(names) == {"DTensor"}, names


def clipped_step_body():
    """A clipped step of FSDP2 shards (norm above max_norm) folded into the fused step equals clip, then step."""
    from tpflash.train.gradients import clip_grads_, clipped_step
    (folded, folded_opt), (clipped, clipped_opt) = _twin_shards_with_gradients(init_tp(1))
    norm = torch.tensor(50.0)  # any norm the ranks agree on; above max_norm, so the step is clipped
    seen, step = [], folded_opt.step
    folded_opt.step = lambda: (seen.append(getattr(folded_opt, "grad_scale", None)), step())
    clipped_step(folded_opt, list(folded.parameters()), norm, 1.0)
    clip_grads_(list(clipped.parameters()), norm, 1.0)
    clipped_opt.step()
    assert seen[0] is not None, "the fused step was not handed the clipping as its grad_scale"
    _assert_same_parameters(folded, clipped)


def test_clipping_folds_into_its_fused_step_over_fsdp2_shards(ranks):
    ranks(2).run(clipped_step_body)
