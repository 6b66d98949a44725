"""fsdp=zero1 on the ranks' own device: over NCCL where 4 GPUs are visible (gloo on CPU otherwise)."""
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


@pytest.mark.parametrize("tp", [1, 2], ids=["dp4", "dp2-tp2"])
def test_zero1_trains_like_ddp_on_the_ranks_device(ranks, tp):
    ranks(4).run(device_body, tp)
