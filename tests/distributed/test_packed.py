"""GPT.forward on packed batches (cu_seqlens, position_ids, max_seqlen): every document gets exactly the
logits and loss it gets alone (fp32, 1e-5), at tp 1 and at tp 2 with sequence parallelism, for rotary
(Llama) and learned (GPT-2) positions; reduction="sum" is mean * counted tokens; captured CUDA graphs
are not replayed for packed batches; malformed packing raises before any collective."""
import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tpflash.models import GPT, GPTConfig
from tpflash.parallel import comm

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

VOCAB = 61
ROWS = [[6, 10], [16]]  # document lengths per row (seq 16): every one even, so each also runs alone under SP


def tiny(family, **kw):
    if family == "llama":
        return GPTConfig.preset("llama-tiny", vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_kv_head=2,
                                n_embd=32, ffn_hidden=64, **kw)
    return GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32, **kw)


def packed_batch():
    """(idx [2, 16], targets, cu_seqlens, position_ids, documents as (row, start, length))."""
    torch.manual_seed(3)
    idx = torch.randint(0, VOCAB, (len(ROWS), 16))
    targets = torch.randint(0, VOCAB, idx.shape)
    docs, bounds, positions = [], [0], torch.zeros_like(idx)
    for row, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            docs.append((row, start, n))
            positions[row, start:start + n] = torch.arange(n)
            targets[row, start + n - 1] = -100  # no target across a document boundary
            start += n
            bounds.append(row * 16 + start)
    return idx, targets, torch.tensor(bounds, dtype=torch.int32), positions, docs


def packed_body(tp, family, sequence_parallel):
    ps = init_tp(tp) if tp > 1 else None
    group = ps.tp_group if ps else None
    torch.manual_seed(0)
    model = GPT(tiny(family, sequence_parallel=sequence_parallel)).eval()
    idx, targets, cu, pos, docs = packed_batch()
    packing = dict(cu_seqlens=cu, position_ids=pos, max_seqlen=max(n for *_, n in docs))
    with torch.no_grad():
        logits = comm.all_gather(model(idx, **packing), -1, group)[..., :VOCAB]
        derived = comm.all_gather(model(idx, cu_seqlens=cu), -1, group)[..., :VOCAB]  # positions from cu_seqlens
        total = model(idx, targets, reduction="sum", **packing)
        mean = model(idx, targets, **packing)
        alone_total = 0.0
        for row, start, n in docs:
            piece = slice(start, start + n)
            alone = comm.all_gather(model(idx[row:row + 1, piece]), -1, group)[..., :VOCAB]
            assert_close(logits[row:row + 1, piece], alone, f"logits of document {row, start}")
            alone_total += model(idx[row:row + 1, piece], targets[row:row + 1, piece], reduction="sum")
    assert_close(derived, logits, "logits with positions derived from cu_seqlens")
    assert_close(total, alone_total, "summed loss")
    counted = (targets != -100).sum()
    assert_close(mean * counted, total, "mean * counted tokens")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_documents_match_each_document_alone_single_process(family):
    packed_body(1, family, False)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_packed_documents_match_each_document_alone_under_tp_and_sp(ranks, family):
    ranks(2).run(packed_body, 2, family, True)


def test_packed_batch_does_not_replay_captured_graphs():
    torch.manual_seed(0)
    model = GPT(tiny("llama"))
    idx, targets, cu, pos, _ = packed_batch()
    model.capture_cuda_graphs(*idx.shape)
    graphed = model._graphed_blocks
    before = graphed.forward_generation
    loss = model(idx, targets, cu_seqlens=cu, position_ids=pos, max_seqlen=16)
    assert graphed.forward_generation == before, "a packed batch replayed the captured graphs"
    model.release_cuda_graphs()
    assert_close(loss, model(idx, targets, cu_seqlens=cu, position_ids=pos, max_seqlen=16), "loss")
    model.capture_cuda_graphs(*idx.shape)
    model(idx, targets)
    assert model._graphed_blocks.forward_generation == 1, "an unpacked batch should replay"


@pytest.mark.parametrize("kw,rule", [
    (dict(cu_seqlens=torch.tensor([0, 6, 32])), "cu_seqlens dtype torch.int64 must be torch.int32"),
    (dict(cu_seqlens=torch.tensor([0, 20, 32], dtype=torch.int32)), "must contain every row boundary"),
    (dict(cu_seqlens=torch.tensor([0, 16, 30], dtype=torch.int32)), "must run from 0 to batch\\*seq=32"),
    (dict(position_ids=torch.zeros(2, 8, dtype=torch.long)), "position_ids shape \\(2, 8\\) != idx shape"),
    (dict(max_seqlen=4), "max_seqlen=4 is given without cu_seqlens"),
    (dict(reduction="none"), "reduction='none' must be 'mean' or 'sum'"),
])
def test_malformed_packing_raises(kw, rule):
    model = GPT(tiny("llama"))
    idx = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=rule):
        model(idx, **kw)
