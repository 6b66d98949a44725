"""ParallelAttention equals plain attention (nn.Linear + SDPA): forward and backward, tp in {2, 4},
with and without sequence parallelism, MHA and GQA (kv heads sharded or replicated), rotary."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tests.models.reference import RefAttention, check_against_reference
from tpflash.layers import ParallelAttention
from tpflash.parallel import full_state_dict, set_default_state

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

HIDDEN = 32


def attention_body(tp, n_head, n_kv_head, rotary, sequence_parallel):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelAttention(HIDDEN, n_head, n_kv_head, position="rotary" if rotary else "learned",
                              sequence_parallel=sequence_parallel)
    ref = RefAttention(HIDDEN, n_head, n_kv_head, rotary=rotary)
    check_against_reference(ps, layer, ref, HIDDEN, sequence_parallel)


def init_body(tp, n_kv_head):
    """Built after the same seed, the tp layer's full weights are the tp=1 layer's."""
    ps = init_tp(tp)
    torch.manual_seed(0)
    full = full_state_dict(ParallelAttention(HIDDEN, 4, n_kv_head))
    set_default_state(None)  # no default group: a tp=1 layer
    torch.manual_seed(0)
    single = ParallelAttention(HIDDEN, 4, n_kv_head).state_dict()
    set_default_state(ps)
    return {k: torch.equal(v, single[k]) for k, v in full.items()}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_attention_matches_reference(ranks, tp, sequence_parallel):
    ranks(tp).run(attention_body, tp, 4, 4, False, sequence_parallel)


@pytest.mark.parametrize("tp,n_kv_head", [(2, 2), (4, 2), (4, 1)])
def test_gqa_rotary_attention_matches_reference(ranks, tp, n_kv_head):
    """n_kv_head=2 at tp=2: kv heads sharded; at tp=4 (and MQA): replicated, gradients summed."""
    ranks(tp).run(attention_body, tp, 4, n_kv_head, True, tp == 4)


@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_attention_init_is_independent_of_tp(ranks, n_kv_head):
    for same in ranks(2).run(init_body, 2, n_kv_head):
        assert all(same.values()), same


@pytest.mark.parametrize("n_head,n_kv_head,tp,rule", [(4, 4, 3, "n_head=4 is not divisible by tp=3"),
                                                      (6, 3, 2, "n_kv_head=3 must divide or be divisible by tp=2"),
                                                      (4, 3, 1, "n_head=4 is not divisible by n_kv_head=3")])
def test_bad_head_layout_raises_before_any_collective(n_head, n_kv_head, tp, rule):
    from tpflash.layers import check_heads
    with pytest.raises(ValueError, match=rule):
        check_heads(n_head, n_kv_head, tp)
