"""The embedding's exchange through peers' memory (tpflash.parallel.peer_embedding), its ranks
simulated in one process: each rank's writes into every rank's buffer give the embedding of that
rank's positions, and the rows each rank reads back give its table shard's gradient, bit for bit
as nn.Embedding. (Over real peers, on GPUs: tests/distributed/test_embedding.py.)"""
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import needs_interpreter
from tpflash.kernels import use_backend
from tpflash.parallel.peer_embedding import read_owned_rows, table_grad, write_owned_rows

DIM, SEQ, BATCH = 5, 8, 3


def _table(vocab_padded, vocab):
    torch.manual_seed(0)
    table = torch.randn(vocab_padded, DIM)
    table[vocab:] = 0  # the padding rows, as VocabParallelEmbedding keeps them
    return table


def _ids(vocab, invalid=False):
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (SEQ, BATCH))
    if invalid:
        ids[1, 2] = 1000  # no rank owns it
    return ids.reshape(-1)  # [seq * batch], seq-first: rank q's positions are chunk q


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("tp,vocab", [(2, 10), (4, 10), (4, 16)])  # 10 is padded to 12 at tp=4
def test_the_rows_each_rank_writes_are_the_embedding_of_every_ranks_positions(backend, tp, vocab):
    padded = -(-vocab // tp) * tp
    rows, table, ids = padded // tp, _table(padded, vocab), _ids(vocab, invalid=True)
    buffers = [torch.full((SEQ * BATCH // tp, DIM), float("nan")) for _ in range(tp)]
    with use_backend(backend):
        for r in range(tp):
            write_owned_rows(ids, table[r * rows:(r + 1) * rows], r * rows, padded, r, buffers)
    expected = F.embedding(ids.clamp(max=padded - 1), table)
    expected[ids >= padded] = 0  # an id no rank owns: zeros, as the group path's masked sum gives
    assert torch.equal(torch.cat(buffers), expected)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("tp,vocab,padding_idx", [(2, 10, None), (4, 10, 7), (4, 16, 0)])
def test_the_rows_each_rank_reads_back_give_its_shards_gradient(backend, tp, vocab, padding_idx):
    padded = -(-vocab // tp) * tp
    rows, ids = padded // tp, _ids(vocab)
    if padding_idx is not None:
        ids[0] = padding_idx
    torch.manual_seed(2)
    grads = list(torch.randn(SEQ * BATCH, DIM).chunk(tp))  # each rank's output gradient, in its buffer
    table = _table(padded, vocab).requires_grad_()
    F.embedding(ids, table, padding_idx).backward(torch.cat(grads))
    with use_backend(backend):
        shards = []
        for r in range(tp):
            local_pad = None if padding_idx is None or not r * rows <= padding_idx < (r + 1) * rows \
                else padding_idx - r * rows
            dense = read_owned_rows(ids, grads, r * rows, rows, r)
            shards.append(table_grad(dense, ids, r * rows, rows, local_pad))
    assert torch.equal(torch.cat(shards), table.grad)
