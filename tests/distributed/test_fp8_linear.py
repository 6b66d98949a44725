"""fp8 column- and row-parallel linear layers at tp 2 and 4, with and without sequence parallelism: on
every rank each GEMM equals the GEMM of its operands fake-quantised (tests/test_fp8_linear.py's
reference) with the scales of the shards that rank multiplies, and the reduced outputs and input
gradients are those GEMMs summed over tp."""
import pytest
import torch
import torch.distributed as dist

from tests.distributed.checks import init_tp
from tests.test_fp8_linear import assert_rel, reference_grads
from tpflash.layers import ColumnParallelLinear, RowParallelLinear
from tpflash.parallel import full_state_dict

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references

SEQ, BATCH, HIDDEN, FFN = 8, 2, 32, 64


def summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def fp8_pair_body(tp, sequence_parallel, recipe):
    ps = init_tp(tp)
    rank = ps.tp_rank
    torch.manual_seed(0)
    col = ColumnParallelLinear(HIDDEN, FFN, bias=False, sequence_parallel=sequence_parallel, fp8=recipe)
    row = RowParallelLinear(FFN, HIDDEN, bias=False, sequence_parallel=sequence_parallel, fp8=recipe)
    w1, w2 = full_state_dict(col)["weight"], full_state_dict(row)["weight"]  # [FFN, HIDDEN], [HIDDEN, FFN]
    torch.manual_seed(1)  # the same activations on every rank
    x, dy = torch.randn(SEQ, BATCH, HIDDEN), torch.randn(SEQ, BATCH, HIDDEN) * 1e-2
    local = (lambda t: t.chunk(tp)[rank].contiguous()) if sequence_parallel else (lambda t: t)  # noqa: E731
    x_in = local(x).requires_grad_()
    h = col(x_in)  # [SEQ, BATCH, FFN/tp]
    h.retain_grad()
    y = row(h)
    y.backward(local(dy))

    m, shard = SEQ * BATCH, slice(rank * FFN // tp, (rank + 1) * FFN // tp)
    # row-parallel: this rank's h columns against its W2 columns, every rank's partial product summed
    y_part, dh_ref, dw2_ref = reference_grads(h.detach().view(m, -1), w2[:, shard], dy.view(m, HIDDEN), recipe)
    assert_rel(y.view(-1, HIDDEN), local(summed(y_part).view(SEQ, BATCH, HIDDEN)).view(-1, HIDDEN))
    assert_rel(h.grad.view(m, -1), dh_ref)
    assert_rel(row.weight.grad, dw2_ref)
    # column-parallel: the whole (gathered) x against this rank's W1 rows; x's gradient summed over tp
    h_ref, dx_part, dw1_ref = reference_grads(x.view(m, HIDDEN), w1[shard], h.grad.view(m, -1), recipe)
    assert_rel(h.detach().view(m, -1), h_ref)
    assert_rel(col.weight.grad, dw1_ref)
    assert_rel(x_in.grad.reshape(-1, HIDDEN), local(summed(dx_part).view(SEQ, BATCH, HIDDEN)).reshape(-1, HIDDEN))


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_fp8_column_and_row_parallel_gemms_equal_their_fake_quantised_reference(ranks, tp, sequence_parallel, recipe):
    ranks(tp).run(fp8_pair_body, tp, sequence_parallel, recipe)


def fp8_gpt_curve_body(tp, sequence_parallel, recipe, family="llama", steps=20):
    """(losses at tp with fp8, losses of the same fp8 model in one process, losses without fp8)."""
    from tests.distributed.test_gpt import batch, tiny_config, twin_models
    ps = init_tp(tp)
    model, single = twin_models(ps, tiny_config(family, sequence_parallel, fp8=recipe))
    _, exact = twin_models(ps, tiny_config(family, sequence_parallel))
    curves = []
    for m in (model, single, exact):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses = []
        for step in range(steps):
            idx, targets = batch(seed=100 + step % 2)  # two batches to memorise: the loss must fall
            opt.zero_grad()
            loss = m(idx, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    return curves


@pytest.mark.parametrize("recipe,sequence_parallel,family", [("rowwise", True, "llama"), ("tensorwise", False, "llama"),
                                                             ("rowwise", False, "gpt2"), ("tensorwise", True, "gpt2"),
                                                             ("delayed", True, "llama")])
def test_a_gpt_with_fp8_trains_at_tp2_like_one_process(ranks, recipe, sequence_parallel, family):
    for tp2, single, exact in ranks(2).run(fp8_gpt_curve_body, 2, sequence_parallel, recipe, family):
        assert tp2[-1] < 4.0  # it learned: ln(101) = 4.6 at the start
        assert max(abs(a - b) for a, b in zip(tp2, single)) < 0.05 * single[0]  # per-shard scales: fp8 rounding apart
        assert abs(tp2[-1] - exact[-1]) < 0.05 * exact[0]


def fp8_gather_body(tp, recipe):
    from tpflash.kernels.fp8 import E4M3, quantize
    from tpflash.layers.fp8_linear import _cast_input, _Gather, fp8_linears
    ps = init_tp(tp)
    rank = ps.tp_rank
    torch.manual_seed(1)
    x, w, dy = torch.randn(SEQ, BATCH, HIDDEN), torch.randn(FFN, HIDDEN), torch.randn(SEQ, BATCH, FFN)
    x[5, 1] *= 1e3  # an outlier on one rank: the tensorwise amax must come from it on every rank
    x_local = x.chunk(tp)[rank].contiguous()
    # the cast inputs: gathered fp8 bytes and scales equal the cast of the gathered input, bit for bit
    x8, scale = _cast_input(x_local, recipe, _Gather(ps.tp_group, 0))
    want8, want_scale = quantize(x.view(-1, HIDDEN), E4M3, -1 if recipe == "rowwise" else None)
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(scale, want_scale)
    # the layer: outputs and weight gradient equal the replicated-input path's; x's gradient its chunk
    outs = []
    for x_in, group in ((x_local.clone().requires_grad_(), ps.tp_group), (x.clone().requires_grad_(), None)):
        wl = w.clone().requires_grad_()
        y, = fp8_linears(x_in, [wl], [None], recipe, group)
        y.backward(dy)
        outs.append((y.detach(), wl.grad, x_in.grad))
    (y_sp, dw_sp, dx_sp), (y_full, dw_full, dx_full) = outs
    assert torch.equal(y_sp, y_full) and torch.equal(dw_sp, dw_full)
    assert_rel(dx_sp.reshape(-1, HIDDEN), summed(dx_full).chunk(tp)[rank].reshape(-1, HIDDEN).double(), 1e-6)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
@pytest.mark.parametrize("tp", [2, 4])
def test_the_fp8_all_gather_equals_gathering_then_casting(ranks, tp, recipe):
    ranks(tp).run(fp8_gather_body, tp, recipe)


def delayed_histories_body(tp):
    """Every rank's amax histories after a few steps of a delayed-scaling GPT under SP: they must agree,
    since the ranks gather each other's fp8 activations with the scales taken from them."""
    from tests.distributed.test_gpt import batch, tiny_config
    from tpflash.models import GPT
    ps = init_tp(tp)
    torch.manual_seed(0)
    model = GPT(tiny_config("llama", True, fp8="delayed"), process_group=ps.tp_group)
    for step in range(3):
        idx, targets = batch(seed=100 + step)
        model(idx, targets).backward()
    model(idx, targets)  # its advance reduces the last step's amaxes
    table = model.fp8_history.table[:, 1:].contiguous()  # [:, 0]: this forward's, this rank's own
    tables = [torch.empty_like(table) for _ in range(tp)]
    torch.distributed.all_gather(tables, table, group=ps.tp_group)
    return [torch.equal(t, table) for t in tables], bool((table[:, :3] > 0).all())


@pytest.mark.parametrize("tp", [2, 4])
def test_delayed_amax_histories_agree_over_tp(ranks, tp):
    for agree, recorded in ranks(tp).run(delayed_histories_body, tp):
        assert all(agree) and recorded
