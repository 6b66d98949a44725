"""The collectives of tpflash.parallel.comm: values and gradients against what they mean, tp in {2, 4}."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.distributed.checks import assert_close, init_tp, work_dtype
from tpflash.parallel import comm


def _per_rank(ps, dtype, *shape):
    """A different tensor on every rank (seeded by rank), and the list of all ranks' tensors."""
    all_ranks = []
    for r in range(ps.tp_size):
        torch.manual_seed(100 + r)
        all_ranks.append(torch.randn(*shape, device=ps.device, dtype=dtype))
    return all_ranks[ps.tp_rank].clone().requires_grad_(), all_ranks


def gather_along_seq_body(tp, dim):
    """all_gather_along_seq = concatenation of every rank's piece; its backward sums the gradients
    of all ranks and keeps this rank's piece (a reduce-scatter)."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    x, xs = _per_rank(ps, dtype, 2, 3, 4)
    y = comm.all_gather_along_seq(x, ps.tp_group, seq_dim=dim)
    assert_close(y, torch.cat(xs, dim=dim), "all-gather value")
    grads = _per_rank(ps, dtype, *y.shape)[1]  # rank r's upstream gradient
    y.backward(grads[ps.tp_rank])
    expected = sum(grads).chunk(tp, dim=dim)[ps.tp_rank]
    assert_close(x.grad, expected, "all-gather backward (reduce-scatter)")


def reduce_scatter_along_seq_body(tp, dim):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    shape = [2, 3, 4]
    shape[dim] *= tp
    x, xs = _per_rank(ps, dtype, *shape)
    y = comm.reduce_scatter_along_seq(x, ps.tp_group, seq_dim=dim)
    assert_close(y, sum(xs).chunk(tp, dim=dim)[ps.tp_rank], "reduce-scatter value")
    grads = _per_rank(ps, dtype, *y.shape)[1]
    y.backward(grads[ps.tp_rank])
    assert_close(x.grad, torch.cat(grads, dim=dim), "reduce-scatter backward (all-gather)")


def copy_reduce_split_gather_body(tp):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    x, xs = _per_rank(ps, dtype, 3, 4 * tp)
    grads = _per_rank(ps, dtype, 3, 4 * tp)[1]

    y = comm.copy_to_tp_region(x, ps.tp_group)
    assert torch.equal(y, x)
    y.backward(grads[ps.tp_rank])
    assert_close(x.grad, sum(grads), "copy_to_tp_region backward (all-reduce)")

    x.grad = None
    y = comm.reduce_from_tp_region(x, ps.tp_group)
    assert_close(y, sum(xs), "reduce_from_tp_region value")
    y.backward(grads[ps.tp_rank])
    assert torch.equal(x.grad, grads[ps.tp_rank]), "reduce_from_tp_region backward is the identity"

    full = xs[0].detach().clone().requires_grad_()  # the same tensor on every rank
    piece = comm.split_along_dim(full, -1, ps.tp_group)
    assert torch.equal(piece, xs[0].chunk(tp, -1)[ps.tp_rank])
    piece.backward(grads[ps.tp_rank].chunk(tp, -1)[ps.tp_rank])
    assert_close(full.grad, torch.cat([g.chunk(tp, -1)[r] for r, g in enumerate(grads)], -1), "split backward")

    local = xs[ps.tp_rank].detach().clone().requires_grad_()
    gathered = comm.gather_along_dim(local, -1, ps.tp_group)
    assert_close(gathered, torch.cat(xs, -1), "gather value")
    gathered.backward(grads[0].repeat(1, tp))  # replicated downstream gradient
    assert_close(local.grad, grads[0].repeat(1, tp).chunk(tp, -1)[ps.tp_rank], "gather backward (split)")


def async_equals_sync_body(tp):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    x = _per_rank(ps, dtype, 2 * tp, 3)[0].detach()
    handles = [comm.all_gather_async(x, 1, ps.tp_group), comm.reduce_scatter_async(x, 0, ps.tp_group),
               comm.all_reduce_async(x, ps.tp_group)]  # all in flight at once
    results = [h.wait() for h in handles]
    assert torch.equal(results[0], comm.all_gather(x, 1, ps.tp_group))
    assert_close(results[1], comm.reduce_scatter(x, 0, ps.tp_group), "reduce-scatter")  # sums: NCCL may
    assert_close(results[2], comm.all_reduce(x, ps.tp_group), "all-reduce")  # pick another algorithm


def indivisible_body():
    ps = init_tp(2)
    with pytest.raises(ValueError, match=r"reduce_scatter: size 3 of dim 0 .* is not divisible by the group size 2"):
        comm.reduce_scatter_along_seq(torch.ones(3, 2, device=ps.device), ps.tp_group)
    dist.barrier()  # every rank raised before any collective: the group is still in step


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_along_seq_concatenates_and_reduce_scatters_its_gradient(ranks, tp, dim):
    ranks(tp).run(gather_along_seq_body, tp, dim)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 2])
def test_reduce_scatter_along_seq_sums_and_all_gathers_its_gradient(ranks, tp, dim):
    ranks(tp).run(reduce_scatter_along_seq_body, tp, dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_reduce_split_gather_are_each_others_duals(ranks, tp):
    ranks(tp).run(copy_reduce_split_gather_body, tp)


def copy_many_body(tp):
    """copy_to_tp_region_many: identity forward; each gradient summed over ranks, by one all-reduce."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    w, b = _per_rank(ps, dtype, 5, 3)[0], _per_rank(ps, dtype, 7)[0]
    grads_w, grads_b = _per_rank(ps, dtype, 5, 3)[1], _per_rank(ps, dtype, 7)[1]
    calls = []
    real_all_reduce = comm.all_reduce
    comm.all_reduce = lambda x, group: calls.append(tuple(x.shape)) or real_all_reduce(x, group)
    try:
        w2, b2 = comm.copy_to_tp_region_many([w, b], ps.tp_group)
        assert torch.equal(w2, w) and torch.equal(b2, b)
        torch.autograd.backward([w2, b2], [grads_w[ps.tp_rank], grads_b[ps.tp_rank]])
    finally:
        comm.all_reduce = real_all_reduce
    assert calls == [(5 * 3 + 7,)], f"expected one all-reduce of 22 elements, got {calls}"
    assert_close(w.grad, sum(grads_w), "first gradient summed over ranks")
    assert_close(b.grad, sum(grads_b), "second gradient summed over ranks")


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_to_tp_region_many_sums_every_gradient_in_one_all_reduce(ranks, tp):
    ranks(tp).run(copy_many_body, tp)


@contextlib.contextmanager
def _counting_all_reduces():
    """The shapes of comm.all_reduce's calls, as a list filled while inside."""
    calls, real_all_reduce = [], comm.all_reduce
    comm.all_reduce = lambda x, group: calls.append(tuple(x.shape)) or real_all_reduce(x, group)
    try:
        yield calls
    finally:
        comm.all_reduce = real_all_reduce


def grad_aliases_body(tp):
    """tp_grad_aliases: every use of an alias takes the gradient into the one all-reduce per dtype that
    runs when the whole backward is done, however many uses there were; each gradient is still the
    sum over ranks."""
    ps = init_tp(tp)
    w, ws = _per_rank(ps, torch.float32, 5, 3)
    b, bs = _per_rank(ps, torch.float32, 3)
    d, ds = _per_rank(ps, torch.float64, 4)
    with _counting_all_reduces() as calls:
        aliases = comm.tp_grad_aliases([w, b, d], ps.tp_group)
        w1, w2, b2, d2 = aliases[id(w)], aliases[id(w)], aliases[id(b)], aliases[id(d)]
        loss = (w1 * w2).sum() + (w2 @ b2).sum() + d2.pow(2).sum()
        loss.backward()
    assert sorted(calls) == [(4,), (5 * 3 + 3,)], f"expected one all-reduce per dtype, got {calls}"
    # per-rank gradient of the loss above, summed over ranks
    assert_close(w.grad, sum(2 * wr + br.expand(5, 3) for wr, br in zip(ws, bs)), "twice-used tensor")
    assert_close(b.grad, sum(wr.sum(0) for wr in ws), "tensor used once")
    assert_close(d.grad, sum(2 * dr for dr in ds), "float64 tensor (its own all-reduce)")


@pytest.mark.parametrize("tp", [2, 4])
def test_grad_aliases_sum_every_gradient_in_one_all_reduce_per_dtype(ranks, tp):
    ranks(tp).run(grad_aliases_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_async_collectives_return_what_the_blocking_ones_do(ranks, tp):
    ranks(tp).run(async_equals_sync_body, tp)


def test_indivisible_reduce_scatter_raises_before_communicating(ranks):
    ranks(2).run(indivisible_body)


def test_collectives_are_the_identity_without_a_group():
    x = torch.randn(4, 2)
    for f in (comm.copy_to_tp_region, comm.reduce_from_tp_region, comm.all_gather_along_seq,
              comm.reduce_scatter_along_seq):
        assert f(x, None) is x
