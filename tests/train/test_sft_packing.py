"""Packing fine-tuning examples into rows: full rows, whole documents, positions, offsets, determinism."""
import numpy as np
import pytest

from tpflash.train.packing import IGNORE_INDEX, best_fit, pack_examples
from tpflash.train.sft_data import Example

SEQ = 16


def _examples(lengths, prompt=2):
    """Examples of the given lengths whose ids name them (example k: 100 * (k + 1) + j, never the
    padding's 0); the first `prompt` tokens (at most all but one) are prompt."""
    out = []
    for k, n in enumerate(lengths):
        loss = np.arange(n) >= min(prompt, n - 1)
        out.append(Example(100 * (k + 1) + np.arange(n, dtype=np.int64), loss, f"f:{k + 1}"))
    return out


def _documents(rows, r):
    """Row r's documents as lists of input ids, the padding left out."""
    ids, cut = rows.batch([r]).inputs[0].numpy(), np.cumsum(rows.doc_lens(r))[:-1]
    return [d.tolist() for d in np.split(ids, cut) if d[0] != 0]


LENGTHS = [5, 9, 3, 7, 12, 4, 6, 2, 8, 11, 3, 5]


def test_rows_are_full_and_documents_stay_whole():
    examples = _examples(LENGTHS)
    rows, _, _ = pack_examples(examples, SEQ, seed=0, eval_fraction=0)
    seen = []
    for r in range(len(rows)):
        assert rows.doc_lens(r).sum() == SEQ
        for d in _documents(rows, r):
            k = d[0] // 100 - 1
            assert d == list(range(d[0], d[0] + LENGTHS[k])), f"row {r}: example {k} is split or altered"
            seen.append(k)
    assert sorted(seen) == list(range(len(LENGTHS))), "every example lands in exactly one row"
    assert len(rows) == int(np.ceil(sum(LENGTHS) / SEQ)), "these lengths pack without a spare row"


def test_positions_restart_and_cu_seqlens_mark_every_document():
    rows, _, _ = pack_examples(_examples(LENGTHS), SEQ, seed=0, eval_fraction=0)
    batch = rows.batch([1, 0])
    lens = np.concatenate([rows.doc_lens(1), rows.doc_lens(0)])
    assert batch.cu_seqlens.tolist() == [0] + np.cumsum(lens).tolist() and batch.cu_seqlens[-1] == 2 * SEQ
    assert batch.positions.reshape(-1).tolist() == [p for n in lens for p in range(n)]
    assert batch.max_seqlen == lens.max()
    assert str(batch.cu_seqlens.dtype) == "torch.int32"


def test_no_target_crosses_a_document_boundary_and_padding_counts_nothing():
    rows, _, _ = pack_examples(_examples(LENGTHS), SEQ, seed=0, eval_fraction=0)
    for r in range(len(rows)):
        targets = rows.batch([r]).targets[0]
        ends = np.cumsum(rows.doc_lens(r)) - 1
        assert (targets[ends] == IGNORE_INDEX).all(), "a document's last position predicts nothing"
        inputs = rows.batch([r]).inputs[0]
        for start, n in zip(ends - rows.doc_lens(r) + 1, rows.doc_lens(r)):
            t, i = targets[start:start + n - 1], inputs[start + 1:start + n]
            assert ((t == IGNORE_INDEX) | (t == i)).all(), "a target is the next token of its own document"
    # an example of n tokens predicts its tokens 2..n-1 (n > 2), or its last (n = 2)
    assert rows.loss_tokens(range(len(rows))) == sum(max(n - 2, 1) for n in LENGTHS)


def test_packing_is_a_deterministic_function_of_the_seed():
    a = pack_examples(_examples(LENGTHS), SEQ, seed=3, eval_fraction=0.2)
    b = pack_examples(_examples(LENGTHS), SEQ, seed=3, eval_fraction=0.2)
    c = pack_examples(_examples(LENGTHS), SEQ, seed=4, eval_fraction=0.2)
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x._doc_lens, y._doc_lens)
    assert not np.array_equal(a[0].tokens, c[0].tokens)


def test_the_held_out_split_is_whole_examples_apart_from_the_training_ones():
    train, held, notes = pack_examples(_examples(LENGTHS), SEQ, seed=1, eval_fraction=0.25)
    ids = lambda rows: {d[0] // 100 for r in range(len(rows)) for d in _documents(rows, r)}
    assert len(ids(held)) == 3 and not ids(held) & ids(train)
    assert "9 train / 3 held-out examples" in notes[-1]


def test_long_examples_are_cut_to_seq_len_and_counted_once():
    train, _, notes = pack_examples(_examples([40, 5, 30]), SEQ, seed=0, eval_fraction=0)
    assert notes[0] == f"2 of 3 examples are longer than seq_len={SEQ} tokens: cut to it"
    docs = {d[0] // 100: d for r in range(len(train)) for d in _documents(train, r)}
    assert docs[1] == list(range(100, 100 + SEQ)) and docs[3] == list(range(300, 300 + SEQ)), "the heads are kept"


def test_examples_left_without_loss_tokens_are_dropped_and_counted():
    examples = _examples([5, 6]) + [Example(1 + np.arange(30), np.arange(30) >= 20, "f:3")]  # completion past SEQ
    train, _, notes = pack_examples(examples, SEQ, seed=0, eval_fraction=0)
    assert any(n.startswith("1 examples have no token that carries loss within seq_len=16") and "f:3" in n
               for n in notes)
    assert train.loss_tokens(range(len(train))) == 3 + 4


def test_all_examples_without_loss_tokens_is_an_error():
    with pytest.raises(ValueError, match=r"no example has a token that carries loss within seq_len=16 tokens "
                                         r"\(1 examples, e.g. f:9\)"):
        pack_examples([Example(np.arange(4), np.zeros(4, bool), "f:9")], SEQ, seed=0, eval_fraction=0)


def test_without_pack_every_example_has_a_padded_row_of_its_own():
    rows, _, _ = pack_examples(_examples(LENGTHS), SEQ, seed=0, eval_fraction=0, packed=False)
    assert len(rows) == len(LENGTHS)
    assert sorted(rows.doc_lens(r)[0] for r in range(len(rows))) == sorted(LENGTHS)
    assert all(rows.doc_lens(r).sum() == SEQ and len(rows.doc_lens(r)) <= 2 for r in range(len(rows)))


def test_best_fit_puts_each_document_in_the_tightest_row_that_holds_it():
    # 5 goes to row 0 (room 6, not row 1's 8), 6 to row 1, and 2 fills row 1 (room 2, not row 0's 1)
    assert best_fit([10, 8, 5, 6, 2], 16) == [[0, 2], [1, 3, 4]]
