"""ParallelMLP equals the plain MLP (GELU tanh and SwiGLU): forward and backward, tp in {2, 4}, +/- SP."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tests.models.reference import RefMLP, check_against_reference
from tpflash.layers import ParallelMLP

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

HIDDEN, FFN = 16, 64


def mlp_body(tp, mlp, bias, sequence_parallel):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelMLP(HIDDEN, FFN, mlp=mlp, bias=bias, sequence_parallel=sequence_parallel)
    check_against_reference(ps, layer, RefMLP(HIDDEN, FFN, mlp, bias), HIDDEN, sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gelu_mlp_matches_reference(ranks, tp, sequence_parallel):
    ranks(tp).run(mlp_body, tp, "gelu", True, sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_swiglu_mlp_matches_reference(ranks, tp, sequence_parallel):
    ranks(tp).run(mlp_body, tp, "swiglu", False, sequence_parallel)


def test_unknown_mlp_raises():
    with pytest.raises(ValueError, match="mlp='tanh' must be one of"):
        ParallelMLP(HIDDEN, FFN, mlp="tanh")
