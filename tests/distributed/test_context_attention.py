"""Context-parallel attention (ring and all-gather) equals single-process attention over the whole
sequence, forward and backward, at cp 2 and 4: causal and not, GQA, chunks of odd length."""
import pytest
import torch
import torch.distributed as dist

from tests.distributed.checks import assert_close, work_dtype
from tpflash.kernels import flash_attention
from tpflash.kernels.reference import attention_reference
from tpflash.parallel.context_attention import context_parallel_attention
from tpflash.parallel.zigzag import natural_order, zigzag_positions, zigzag_shard, zigzag_unshard

pytestmark = pytest.mark.cpu_ranks


def cp_attention_body(seq, heads_q, heads_kv, causal, cp_comm, head_dim=8, on_device=False):
    """Every rank draws the same whole-sequence tensors, keeps its zigzag shard, and compares with
    attention over the whole sequence: the fp32 reference on CPU, or with on_device over NCCL, tpflash's
    flash attention on the rank's GPU in bf16 (the ring's blocks then run the Triton kernels)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    gpu = on_device and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    whole_attention = flash_attention if gpu else attention_reference
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, seq, h, head_dim, generator=gen).to(device, work_dtype(device))
                     for h in (heads_q, heads_kv, heads_kv, heads_q))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = whole_attention(*leaves, causal=causal)
    ref.backward(grad)
    local = [zigzag_shard(t, 1, rank, cp).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, dist.group.WORLD, causal=causal, cp_comm=cp_comm)
    out.backward(zigzag_shard(grad, 1, rank, cp))
    assert out.dtype == q.dtype
    assert_close(out, zigzag_shard(ref, 1, rank, cp), "out")
    for name, mine, leaf in zip(("dq", "dk", "dv"), local, leaves):
        assert_close(mine.grad, zigzag_shard(leaf.grad, 1, rank, cp), name)


@pytest.mark.parametrize("cp_comm", ["ring", "allgather"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_equals_whole_sequence_attention(ranks, cp, causal, cp_comm):
    ranks(cp).run(cp_attention_body, 8 * cp, 4, 4, causal, cp_comm)


@pytest.mark.parametrize("cp_comm", ["ring", "allgather"])
@pytest.mark.parametrize("heads_kv", [2, 1])
def test_gqa_and_mqa_under_context_parallelism(ranks, cp_comm, heads_kv):
    ranks(2).run(cp_attention_body, 16, 4, heads_kv, True, cp_comm)


@pytest.mark.parametrize("cp_comm", ["ring", "allgather"])
def test_odd_chunk_lengths_under_context_parallelism(ranks, cp_comm):
    """seq = 2 * cp * 3: every rank holds two chunks of 3 tokens."""
    ranks(4).run(cp_attention_body, 24, 2, 1, True, cp_comm)


def bad_shape_body():
    q = torch.zeros(1, 5, 2, 8)
    with pytest.raises(ValueError, match="this rank's sequence length 5 must be even"):
        context_parallel_attention(q, q, q, dist.group.WORLD)


def test_odd_local_sequence_is_refused_before_any_communication(ranks):
    ranks(2).run(bad_shape_body)


def test_zigzag_pairs_mirrored_chunks_and_round_trips():
    x = torch.arange(16)
    shards = [zigzag_shard(x, 0, r, 4) for r in range(4)]
    assert shards[0].tolist() == [0, 1, 14, 15] and shards[3].tolist() == [6, 7, 8, 9]
    assert torch.equal(zigzag_unshard(shards, 0), x)
    assert all(torch.equal(zigzag_positions(16, r, 4), shards[r]) for r in range(4))
    assert natural_order(2) == [0, 2, 3, 1]


def test_sequence_not_divisible_by_two_cp_is_one_clear_error():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2\*cp=8"):
        zigzag_positions(12, 0, 4)
