"""ParallelAttention's Llama-family variants equal plain attention (nn.Linear + SDPA), forward and backward,
at tp 2 and 4 with and without sequence parallelism: Qwen3's per-head q/k RMSNorm with a head_dim that is
not hidden / n_head (the norm weights' gradients, partial per rank, summed over tp), and Qwen2's q/k/v-only
biases."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tests.models.reference import RefAttention, check_against_reference
from tpflash.layers import ParallelAttention
from tpflash.layers.block import ParallelTransformerBlock

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

HIDDEN = 32


def qk_norm_body(tp, n_kv_head, sequence_parallel):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelAttention(HIDDEN, 4, n_kv_head, bias=False, position="rotary", head_dim=16, qk_norm=True,
                              norm_eps=1e-6, sequence_parallel=sequence_parallel)
    with torch.no_grad():  # non-trivial norm weights, the same on every rank
        torch.manual_seed(5)
        layer.q_norm.weight.copy_(1 + 0.1 * torch.randn(16))
        layer.k_norm.weight.copy_(1 + 0.1 * torch.randn(16))
    ref = RefAttention(HIDDEN, 4, n_kv_head, bias=False, rotary=True, head_dim=16, qk_norm=True)
    check_against_reference(ps, layer, ref, HIDDEN, sequence_parallel)


def qkv_bias_body(tp, sequence_parallel):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelAttention(HIDDEN, 4, 2, bias=False, qkv_bias=True, position="rotary",
                              sequence_parallel=sequence_parallel)
    assert layer.o_proj.bias is None and layer.q_proj.bias is not None
    ref = RefAttention(HIDDEN, 4, 2, bias=False, qkv_bias=True, rotary=True)
    check_against_reference(ps, layer, ref, HIDDEN, sequence_parallel)


def partial_grads_body(tp):
    """The block's one all-reduce of partial gradients covers q_norm/k_norm whenever tp > 1."""
    init_tp(tp)
    block = ParallelTransformerBlock(HIDDEN, 4, 2, 64, mlp="swiglu", norm="rmsnorm", position="rotary", bias=False,
                                     head_dim=16, qk_norm=True)
    names = {id(p): n for n, p in block.named_parameters()}
    return sorted(names[id(p)] for p in block.tp_partial_grad_parameters())


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp,n_kv_head", [(2, 2), (4, 2)])
def test_qk_norm_attention_with_wide_heads_matches_reference(ranks, tp, n_kv_head, sequence_parallel):
    """n_kv_head=2: kv heads sharded at tp=2, replicated at tp=4."""
    ranks(tp).run(qk_norm_body, tp, n_kv_head, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_qkv_only_biases_match_reference(ranks, sequence_parallel):
    ranks(2).run(qkv_bias_body, 2, sequence_parallel)


def test_qk_norm_weights_are_tp_partial_gradients(ranks):
    for names in ranks(2).run(partial_grads_body, 2):
        assert names == ["attn.k_norm.weight", "attn.q_norm.weight"], names


def test_wide_heads_shapes_single_process():
    layer = ParallelAttention(HIDDEN, 4, 2, bias=False, head_dim=16, qk_norm=True)
    assert layer.q_proj.weight.shape == (64, 32) and layer.o_proj.weight.shape == (32, 64)
    assert layer.k_proj.weight.shape == (32, 32) and layer.q_norm.weight.shape == (16,)
    assert layer(torch.randn(8, 2, HIDDEN)).shape == (8, 2, HIDDEN)
