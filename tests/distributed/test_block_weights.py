"""BlockWeights: what a block's layers take in place of their parameters during one forward. The
aliases given by `use` carry their gradients into the block's one all-reduce; parameters without
one are summed over tp on their own; `use` nests, and leaves nothing behind."""
import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tpflash.layers.block_weights import BlockWeights
from tpflash.layers.weight_casts import cast_now
from tpflash.parallel import comm

pytestmark = pytest.mark.cpu_ranks


def _per_rank(ps, *shape):
    """A different fp32 leaf on every rank (seeded by rank), and the list of all ranks' values."""
    values = [torch.Generator().manual_seed(100 + r) for r in range(ps.tp_size)]
    values = [torch.randn(*shape, generator=g) for g in values]
    return values[ps.tp_rank].clone().requires_grad_(), values


def summed_body(tp):
    """Inside `use`, a parameter with an alias takes it (its gradient waits for the aliases' one
    all-reduce); one without is summed by one all-reduce of its own; outside, every one is."""
    ps = init_tp(tp)
    w, ws = _per_rank(ps, 6)
    c, cs = _per_rank(ps, 2)
    calls, real = [], comm.all_reduce
    comm.all_reduce = lambda t, group: calls.append(t.numel()) or real(t, group)
    try:
        weights = BlockWeights()
        aliases = comm.tp_grad_aliases([w], ps.tp_group)
        with weights.use(None, aliases):
            w_used, c_used, none = weights.summed_over_tp([w, c, None], ps.tp_group)
            assert w_used is aliases[id(w)] and none is None
        (w_used.sum() * c_used.sum()).backward()
        assert sorted(calls) == [2, 6], f"all-reduces of {calls} elements: one for w's aliases, one for c"
        assert_close(w.grad, sum(cr.sum().expand(6) for cr in cs), "w through its alias")
        assert_close(c.grad, sum(wr.sum().expand(2) for wr in ws), "c summed on its own")
        assert weights.aliases is None and weights.casts is None, "use leaves nothing behind"
        calls.clear()
        w.grad = None
        weights.summed_over_tp([w], ps.tp_group)[0].sum().backward()
        assert calls == [6], "outside use, the parameter is summed on its own"
    finally:
        comm.all_reduce = real


@pytest.mark.parametrize("tp", [2, 4])
def test_a_parameter_takes_its_alias_inside_use_and_is_summed_on_its_own_without(ranks, tp):
    ranks(tp).run(summed_body, tp)


def test_a_nested_use_keeps_what_the_enclosing_one_gave_where_it_gives_none():
    weights, w = BlockWeights(), torch.randn(3, 4)
    outer, inner = cast_now([(w,)], torch.bfloat16), cast_now([(w,)], torch.bfloat16)
    outer_aliases = {id(w): w.view_as(w)}
    with weights.use(outer, outer_aliases):
        with weights.use(None, None):
            assert weights.casts is outer and weights.aliases is outer_aliases
        with weights.use(inner, None):
            assert weights.casts is inner and weights.aliases is outer_aliases
        assert weights.casts is outer
    assert weights.casts is None and weights.aliases is None
