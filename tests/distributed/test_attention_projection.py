"""The attention computed by query chunks feeding the output projection's reduce-scatter
(tpflash.parallel.attention_projection): where o_proj overlaps, ParallelAttention takes it, and it
equals plain attention (the single-process reference) and the unchunked path, forward and backward;
on CPU over gloo, on GPUs through peer memory with cuDNN's attention."""
import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tests.models.reference import RefAttention, check_against_reference
from tpflash.layers import ParallelAttention
from tpflash.layers import attention as attention_module
from tpflash.parallel import overlap
from tpflash.parallel.attention_projection import attention_reduce_scatter

HIDDEN = 32


class _CountChunked:
    """Counts the forwards that took the chunked path (ParallelAttention's call of attention_reduce_scatter)."""

    def __enter__(self):
        self.calls, self.real = 0, attention_module.attention_reduce_scatter

        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)
        attention_module.attention_reduce_scatter = counted
        return self

    def __exit__(self, *exc):
        attention_module.attention_reduce_scatter = self.real


def reference_body(tp, n_kv_head, bias):
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = ParallelAttention(HIDDEN, 4, n_kv_head, bias=bias, position="rotary", sequence_parallel=True)
    overlap.set_overlap(layer, True)
    ref = RefAttention(HIDDEN, 4, n_kv_head, bias=bias, rotary=True)
    with _CountChunked() as chunked:
        check_against_reference(ps, layer, ref, HIDDEN, sequence_parallel=True)
    assert chunked.calls == 1, f"the chunked path ran {chunked.calls} times, expected once"


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("n_kv_head, bias", [(4, True), (2, False), (1, True)], ids=["mha_bias", "gqa", "mqa_bias"])
def test_attention_by_chunks_into_the_projection_matches_plain_attention(ranks, tp, n_kv_head, bias):
    ranks(tp).run(reference_body, tp, n_kv_head, bias)


def on_off_body(tp, n_head, n_kv_head, head_dim):
    """The chunked path against ParallelAttention's unchunked one (overlap off) on this rank's device:
    bf16 and cuDNN on GPUs (where the copy engines carry the reduce-scatter), fp32 on CPU."""
    ps = init_tp(tp)
    dtype = torch.bfloat16 if ps.device.type == "cuda" else torch.float32
    hidden, seq, batch = n_head * head_dim, 64, 2
    torch.manual_seed(0)
    layer = ParallelAttention(hidden, n_head, n_kv_head, position="rotary", sequence_parallel=True,
                              device=ps.device, dtype=dtype)
    torch.manual_seed(1)
    x = torch.randn(seq, batch, hidden, device=ps.device, dtype=dtype)
    grad = torch.randn(seq // tp, batch, hidden, device=ps.device, dtype=dtype)
    rows = slice(ps.tp_rank * seq // tp, (ps.tp_rank + 1) * seq // tp)

    def run():
        x_local = x[rows].clone().requires_grad_()
        out = layer(x_local)
        out.backward(grad)
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad()
        return out.detach(), x_local.grad, grads

    overlap.set_overlap(layer, False)
    plain = run()
    overlap.set_overlap(layer, True)
    with _CountChunked() as chunked:
        got = run()
    assert chunked.calls == 1, "the chunked path did not run"
    for what, a, b in (("output", got[0], plain[0]), ("input grad", got[1], plain[1])):
        assert_close(a, b, f"tp={tp} {what}")
    for name in plain[2]:
        assert_close(got[2][name], plain[2][name], f"tp={tp} grad of {name}")


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("tp", [2, 4])
def test_attention_by_chunks_matches_the_unchunked_path(ranks, tp):
    ranks(tp).run(on_off_body, tp, 8, 2, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("n_head, n_kv_head, head_dim", [(8, 8, 80), (8, 2, 64)], ids=["mha_80", "gqa_64"])
def test_attention_by_chunks_matches_the_unchunked_path_through_peer_memory(ranks, tp, n_head, n_kv_head, head_dim):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(on_off_body, tp, n_head, n_kv_head, head_dim)


def indivisible_body_with_group():
    ps = init_tp(2)
    q = torch.randn(5, 1, 2, 8)
    try:
        attention_reduce_scatter(q, q, q, 0.3, torch.randn(4, 16), ps.tp_group, "reference")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.cpu_ranks
def test_a_sequence_not_divisible_by_tp_raises_before_any_collective(ranks):
    messages = ranks(2).run(indivisible_body_with_group)
    assert all(m == "sequence length 5 (dim 0 of q (5, 1, 2, 8)) is not divisible by tp=2" for m in messages), messages
