"""ColumnParallelLinear / RowParallelLinear equal nn.Linear: init, forward and backward, tp in {2, 4}."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed.checks import assert_close, init_tp, work_dtype
from tpflash.layers import ColumnParallelLinear, RowParallelLinear
from tpflash.parallel import full_state_dict

SEQ, BATCH, IN, OUT = 8, 3, 16, 24


def _inputs(ps, dtype, *shape):
    torch.manual_seed(1234)  # same data on every rank
    return torch.randn(*shape, device=ps.device, dtype=dtype)


def column_body(tp, gather_output, sequence_parallel):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT, device=ps.device, dtype=dtype)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, gather_output=gather_output, sequence_parallel=sequence_parallel,
                                 device=ps.device, dtype=dtype)
    cols = slice(ps.tp_rank * OUT // tp, (ps.tp_rank + 1) * OUT // tp)
    assert torch.equal(layer.weight, ref.weight[cols]), "initial weight shard differs from nn.Linear's slice"
    assert torch.equal(layer.bias, ref.bias[cols])

    x = _inputs(ps, dtype, SEQ, BATCH, IN)
    grad_y = _inputs(ps, dtype, SEQ, BATCH, OUT) * 0.1
    rows = slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp)
    x_local = (x[rows] if sequence_parallel else x).clone().requires_grad_()
    x_ref = x.clone().requires_grad_()

    y, y_ref = layer(x_local), ref(x_ref)
    expected = y_ref if gather_output else y_ref[..., cols]
    assert_close(y, expected, "output")
    y.backward(grad_y if gather_output else grad_y[..., cols])
    y_ref.backward(grad_y)
    assert_close(x_local.grad, x_ref.grad[rows] if sequence_parallel else x_ref.grad, "input grad")
    assert_close(layer.weight.grad, ref.weight.grad[cols], "weight grad")
    assert_close(layer.bias.grad, ref.bias.grad[cols], "bias grad")


def row_body(tp, input_is_parallel, sequence_parallel):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT, device=ps.device, dtype=dtype)
    torch.manual_seed(0)
    layer = RowParallelLinear(IN, OUT, input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel,
                              device=ps.device, dtype=dtype)
    feats = slice(ps.tp_rank * IN // tp, (ps.tp_rank + 1) * IN // tp)
    assert torch.equal(layer.weight, ref.weight[:, feats]), "initial weight shard differs from nn.Linear's slice"
    assert torch.equal(layer.bias, ref.bias)

    x = _inputs(ps, dtype, SEQ, BATCH, IN)
    grad_y = _inputs(ps, dtype, SEQ, BATCH, OUT) * 0.1
    rows = slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp)
    x_local = (x[..., feats] if input_is_parallel else x).clone().requires_grad_()
    x_ref = x.clone().requires_grad_()

    y, y_ref = layer(x_local), ref(x_ref)
    assert_close(y, y_ref[rows] if sequence_parallel else y_ref, "output")
    y.backward(grad_y[rows] if sequence_parallel else grad_y)
    y_ref.backward(grad_y)
    assert_close(x_local.grad, x_ref.grad[..., feats] if input_is_parallel else x_ref.grad, "input grad")
    assert_close(layer.weight.grad, ref.weight.grad[:, feats], "weight grad")
    assert_close(layer.bias.grad, ref.bias.grad, "bias grad")


def mlp_body(tp, sequence_parallel):
    """Column -> GELU -> Row: the tensor-parallel MLP, against nn.Linear -> GELU -> nn.Linear."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(IN, 4 * IN), nn.GELU(), nn.Linear(4 * IN, IN)).to(ps.device, dtype)
    torch.manual_seed(0)
    mlp = nn.Sequential(ColumnParallelLinear(IN, 4 * IN, sequence_parallel=sequence_parallel),
                        nn.GELU(),
                        RowParallelLinear(4 * IN, IN, sequence_parallel=sequence_parallel)).to(ps.device, dtype)
    x = _inputs(ps, dtype, SEQ, BATCH, IN)
    rows = slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp) if sequence_parallel else slice(None)
    x_local = x[rows].clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    # Under SP each rank's loss covers its own tokens; the weights see the sum, the reference loss.
    mlp(x_local).square().sum().backward()
    ref(x_ref).square().sum().backward()
    assert_close(x_local.grad, x_ref.grad[rows], "input grad")
    full = full_state_dict(mlp)
    grads = {n: p.grad for n, p in mlp.named_parameters()}
    out_cols = slice(ps.tp_rank * 4 * IN // tp, (ps.tp_rank + 1) * 4 * IN // tp)
    assert_close(grads["0.weight"], ref[0].weight.grad[out_cols], "column weight grad")
    assert_close(grads["2.weight"], ref[2].weight.grad[:, out_cols], "row weight grad")
    assert_close(grads["2.bias"], ref[2].bias.grad, "row bias grad")
    for key, value in ref.state_dict().items():
        assert torch.equal(full[key], value), f"full_state_dict[{key}] differs from the reference"

def autocast_gather_body(tp):
    """Under autocast an fp32 sequence-parallel input is cast before the all-gather (half the bytes),
    and the output and gradients still equal nn.Linear's under the same autocast."""
    from tpflash.parallel import comm
    ps = init_tp(tp)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT, device=ps.device)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, sequence_parallel=True, device=ps.device)
    x = _inputs(ps, torch.float32, SEQ, BATCH, IN)
    rows = slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp)
    cols = slice(ps.tp_rank * OUT // tp, (ps.tp_rank + 1) * OUT // tp)
    x_local, x_ref = x[rows].clone().requires_grad_(), x.clone().requires_grad_()
    gathered = []
    real = comm.all_gather_along_seq
    comm.all_gather_along_seq = lambda t, *a, **k: gathered.append(t.dtype) or real(t, *a, **k)
    try:
        with torch.autocast(ps.device.type, dtype=torch.bfloat16):
            y, y_ref = layer(x_local), ref(x_ref)
    finally:
        comm.all_gather_along_seq = real
    assert gathered == [torch.bfloat16], f"all-gather got {gathered}, expected the autocast dtype"
    assert torch.equal(y, y_ref[..., cols]), "output differs from nn.Linear under autocast"
    grad_y = _inputs(ps, torch.bfloat16, SEQ, BATCH, OUT)
    y.backward(grad_y[..., cols])
    y_ref.backward(grad_y)
    assert x_local.grad.dtype == torch.float32
    assert_close(x_local.grad, x_ref.grad[rows], "input grad", tol=2e-2)
    assert_close(layer.weight.grad, ref.weight.grad[cols], "weight grad", tol=2e-2)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_input_is_gathered_in_the_autocast_dtype(ranks, tp):
    ranks(tp).run(autocast_gather_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_matches_nn_linear(ranks, tp, gather_output):
    ranks(tp).run(column_body, tp, gather_output, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_linear_with_sequence_parallel_input(ranks, tp):
    ranks(tp).run(column_body, tp, False, True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_nn_linear(ranks, tp, input_is_parallel):
    ranks(tp).run(row_body, tp, input_is_parallel, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_linear_reduce_scatters_under_sequence_parallel(ranks, tp):
    ranks(tp).run(row_body, tp, True, True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_row_mlp_matches_plain_mlp(ranks, tp, sequence_parallel):
    ranks(tp).run(mlp_body, tp, sequence_parallel)


def test_layers_without_process_group_are_plain_linears():
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    torch.manual_seed(0)
    col = ColumnParallelLinear(IN, OUT)
    torch.manual_seed(0)
    row = RowParallelLinear(IN, OUT)
    x = torch.randn(5, IN)
    assert torch.equal(col(x), ref(x))
    assert torch.equal(row(x), F.linear(x, ref.weight, ref.bias))
