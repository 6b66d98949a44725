"""ParallelMLP equals the plain MLP (GELU tanh and SwiGLU): forward and backward, tp in {2, 4}, +/- SP."""
import weakref

import pytest
import torch

from tests.distributed.checks import init_tp
from tests.kernels.helpers import assert_rel, needs_interpreter
from tests.models.reference import RefMLP, check_against_reference
from tpflash.kernels import use_backend
from tpflash.layers import ParallelMLP

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

HIDDEN, FFN = 16, 64


def mlp_body(tp, mlp, bias, sequence_parallel, fused_dense=False, recompute_activation=False):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelMLP(HIDDEN, FFN, mlp=mlp, bias=bias, sequence_parallel=sequence_parallel, fused_dense=fused_dense,
                        recompute_activation=recompute_activation)
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


@pytest.mark.parametrize("mlp,bias", [("gelu", True), ("gelu", False), ("swiglu", False)])
def test_an_mlp_remaking_its_activation_in_the_backward_matches_reference(ranks, mlp, bias):
    ranks(2).run(mlp_body, 2, mlp, bias, True, False, True)


def _activation_kept_alive(mlp: str, bias: bool, recompute: bool, backend: str = "reference") -> bool:
    """Whether the activation's output (the down projection's input) outlives the forward, held by the graph."""
    torch.manual_seed(0)
    layer = ParallelMLP(HIDDEN, FFN, mlp=mlp, bias=bias, recompute_activation=recompute)
    seen = []
    layer.down_proj.register_forward_pre_hook(lambda module, args: seen.append(weakref.ref(args[0])))
    with use_backend(backend):
        y = layer(torch.randn(7, 3, HIDDEN, requires_grad=True))
        alive = seen[0]() is not None
        y.sum().backward()  # and the backward still runs
    return alive


@pytest.mark.parametrize("mlp,bias", [("gelu", True), ("gelu", False), ("swiglu", False)])
def test_remaking_the_activation_frees_it_after_the_forward(mlp, bias):
    assert _activation_kept_alive(mlp, bias, recompute=False)
    assert not _activation_kept_alive(mlp, bias, recompute=True)


@needs_interpreter
@pytest.mark.parametrize("mlp,bias", [("gelu", True), ("swiglu", False)])
def test_the_triton_activations_remade_in_the_backward_give_the_kept_gradients_bit_for_bit(mlp, bias):
    assert not _activation_kept_alive(mlp, bias, recompute=True, backend="triton")
    x, dy = torch.randn(7, 3, HIDDEN), torch.randn(7, 3, HIDDEN)
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        layer = ParallelMLP(HIDDEN, FFN, mlp=mlp, bias=bias, recompute_activation=recompute)
        xx = x.clone().requires_grad_()
        with use_backend("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xx)
        y.backward(dy.to(y.dtype))
        results.append([y, xx.grad] + [p.grad for p in layer.parameters()])
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_fused_dense_needs_the_tanh_gelu_mlp():
    with pytest.raises(ValueError, match="fused_dense=True needs mlp='gelu'"):
        ParallelMLP(HIDDEN, FFN, mlp="swiglu", fused_dense=True)


def test_unknown_mlp_raises():
    with pytest.raises(ValueError, match="mlp='tanh' must be one of"):
        ParallelMLP(HIDDEN, FFN, mlp="tanh")


@needs_interpreter
def test_swiglu_mlp_on_the_triton_kernels_matches_the_reference_backend():
    # one process: the Triton swiglu (and its one-buffer gradient into the stacked up|gate GEMM)
    # against the same layer on the reference kernels, under bf16 autocast as in training
    torch.manual_seed(0)
    layer = ParallelMLP(HIDDEN, FFN, mlp="swiglu", bias=False)
    x, dy = torch.randn(7, 3, HIDDEN), torch.randn(7, 3, HIDDEN)
    results = []
    for backend in ("triton", "reference"):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        with use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xx)
            y.backward(dy.to(y.dtype))
        results.append([y.float(), xx.grad] + [p.grad for p in layer.parameters()])
    for name, got, want in zip(["out", "x grad", "up", "gate", "down"], *results):
        assert_rel(got, want, torch.bfloat16, name)
