"""VocabParallelEmbedding equals nn.Embedding: init, forward, backward, padding, tp in {2, 4}."""
import pytest
import torch
import torch.nn as nn

from tests.distributed.checks import assert_close, init_tp, work_dtype
from tpflash.layers import VocabParallelEmbedding
from tpflash.parallel import full_state_dict, load_full_state_dict

DIM = 8


def _ids(ps, vocab, *shape):
    torch.manual_seed(99)
    return torch.randint(0, vocab, shape, device=ps.device)


def embedding_body(tp, vocab, padding_idx, sequence_parallel):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, DIM, padding_idx=padding_idx, device=ps.device, dtype=dtype)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(vocab, DIM, padding_idx=padding_idx, sequence_parallel=sequence_parallel,
                                 device=ps.device, dtype=dtype)
    assert emb.num_embeddings_padded % tp == 0 and emb.num_embeddings_padded >= vocab
    full = full_state_dict(emb)
    assert full["weight"].shape == (vocab, DIM), "padding rows must not appear in the full state dict"
    assert torch.equal(full["weight"], ref.weight), "initial table differs from nn.Embedding's"

    ids = _ids(ps, vocab, 8, 3)  # [seq, batch]
    if padding_idx is not None:
        ids[0, 0] = padding_idx
    rows = slice(ps.tp_rank * 8 // tp, (ps.tp_rank + 1) * 8 // tp) if sequence_parallel else slice(None)
    torch.manual_seed(5)
    grad = torch.randn(8, 3, DIM, device=ps.device, dtype=dtype)
    out, out_ref = emb(ids), ref(ids)
    assert_close(out, out_ref[rows], "output")
    out.backward(grad[rows])
    out_ref.backward(grad)
    grad_full = full_state_dict_grad(emb)
    assert_close(grad_full, ref.weight.grad, "weight grad")
    if emb.num_embeddings_padded > vocab and ps.tp_rank == tp - 1:
        padding_rows = emb.weight.grad[vocab - emb.vocab_start:]
        assert padding_rows.abs().sum() == 0, "padding rows received gradient"


def full_state_dict_grad(emb):
    """The unsharded gradient, gathered like the weight itself."""
    from tpflash.parallel import comm
    spec = emb.tp_shard_specs["weight"]
    return spec.unpad(comm.all_gather(emb.weight.grad, spec.dim, emb.process_group))


def load_full_body(tp, vocab):
    ps = init_tp(tp)
    torch.manual_seed(0)
    ref = nn.Embedding(vocab, DIM, device=ps.device)
    emb = VocabParallelEmbedding(vocab, DIM, device=ps.device)  # different draws: overwritten below
    load_full_state_dict(emb, ref.state_dict())
    assert torch.equal(full_state_dict(emb)["weight"], ref.weight)
    ids = _ids(ps, vocab, 5)
    assert_close(emb(ids), ref(ids), "output after load")


def out_of_range_body(tp, bad_id):
    init_tp(tp)
    emb = VocabParallelEmbedding(10, DIM)
    ids = torch.tensor([1, bad_id, 3])
    with pytest.raises(ValueError, match=rf"token id {bad_id} is outside \[0, num_embeddings=10\)"):
        emb(ids)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vocab", [16, 10])  # 10 is padded to 12 at tp=4
def test_vocab_parallel_embedding_matches_nn_embedding(ranks, tp, vocab):
    ranks(tp).run(embedding_body, tp, vocab, None, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_keeps_padding_idx_row_zero_and_gradient_free(ranks, tp):
    ranks(tp).run(embedding_body, tp, 11, 3, False)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_reduce_scatters_under_sequence_parallel(ranks, tp):
    ranks(tp).run(embedding_body, tp, 10, None, True)


@pytest.mark.parametrize("tp", [2, 4])
def test_load_full_state_dict_shards_an_unpadded_table(ranks, tp):
    ranks(tp).run(load_full_body, tp, 13)


@pytest.mark.parametrize("bad_id", [10, -1])
def test_out_of_range_ids_raise_on_every_rank(ranks, bad_id):
    ranks(2).run(out_of_range_body, 2, bad_id)


def test_vocab_parallel_embedding_without_group_is_nn_embedding():
    torch.manual_seed(0)
    ref = nn.Embedding(7, DIM, padding_idx=2)
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(7, DIM, padding_idx=2)
    ids = torch.tensor([[0, 2, 6]])
    assert torch.equal(emb(ids), ref(ids))


def peer_exchange_body(tp):
    """On GPUs that map each other's memory the sequence-parallel embedding goes through peers' memory
    (tpflash.parallel.peer_embedding) and gives the group path's bits, forward and backward, call after
    call (the workspace's two buffers take turns); padding_idx and a vocabulary padded for tp included."""
    import os
    from tpflash.parallel import peer_collectives, peer_embedding
    ps = init_tp(tp)
    assert ps.device.type == "cuda", "needs one GPU per rank"
    vocab, dim, seq, batch = 50_003, 640, 256, 3
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(vocab, dim, padding_idx=11, sequence_parallel=True, device=ps.device)
    assert peer_embedding.reaches(emb.weight, emb.process_group)
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (seq, batch), device=ps.device)
    ids[0, 0] = 11
    grads = [torch.randn(seq // tp, batch, dim, device=ps.device) for _ in range(3)]

    def run(grad):
        emb.weight.grad = None
        out = emb(ids)
        out.backward(grad)
        return out.detach(), emb.weight.grad

    calls, lookup = [], peer_embedding.vocab_lookup
    peer_embedding.vocab_lookup = lambda *args: calls.append(1) or lookup(*args)
    try:
        peer = [run(g) for g in grads]
    finally:
        peer_embedding.vocab_lookup = lookup
    assert len(calls) == len(grads), "the layer did not go through peers' memory"
    os.environ["TPFLASH_COMM_BACKEND"] = "nccl"
    peer_collectives.comm_backend.cache_clear()
    try:
        group = [run(g) for g in grads]
    finally:
        del os.environ["TPFLASH_COMM_BACKEND"]
        peer_collectives.comm_backend.cache_clear()
    for (out, grad), (out_ref, grad_ref) in zip(peer, group):
        assert torch.equal(out, out_ref), "output differs from the group path's"
        assert torch.equal(grad, grad_ref), "table gradient differs from the group path's"


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_the_sequence_parallel_embedding_through_peers_memory_gives_the_group_paths_bits(ranks, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(peer_exchange_body, tp)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_the_sequence_parallel_embedding_through_peers_memory_matches_nn_embedding(ranks, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(embedding_body, tp, 11, 3, True)
