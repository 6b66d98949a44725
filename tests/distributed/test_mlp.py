"""ParallelMLP equals the plain MLP (GELU tanh and SwiGLU): forward and backward, tp in {2, 4}, +/- SP."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tests.models.reference import RefMLP, check_against_reference
from tpflash.layers import ParallelMLP

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

HIDDEN, FFN = 16, 64


def mlp_body(tp, mlp, bias, sequence_parallel, fused_dense=False):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelMLP(HIDDEN, FFN, mlp=mlp, bias=bias, sequence_parallel=sequence_parallel, fused_dense=fused_dense)
    check_against_reference(ps, layer, RefMLP(HIDDEN, FFN, mlp, bias), HIDDEN, sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gelu_mlp_matches_reference(ranks, tp, sequence_parallel):
    ranks(tp).run(mlp_body, tp, "gelu", True, sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_swiglu_mlp_matches_reference(ranks, tp, sequence_parallel):
    ranks(tp).run(mlp_body, tp, "swiglu", False, sequence_parallel)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fused_dense_gelu_mlp_matches_reference(ranks, tp, sequence_parallel):
    # CPU: fused_dense_gelu_dense's composition fallback; the extension itself is tested in tests/kernels
    ranks(tp).run(mlp_body, tp, "gelu", True, sequence_parallel, True)


def test_fused_dense_needs_the_tanh_gelu_mlp():
    with pytest.raises(ValueError, match="fused_dense=True needs mlp='gelu'"):
        ParallelMLP(HIDDEN, FFN, mlp="swiglu", fused_dense=True)


def test_unknown_mlp_raises():
    with pytest.raises(ValueError, match="mlp='tanh' must be one of"):
        ParallelMLP(HIDDEN, FFN, mlp="tanh")
