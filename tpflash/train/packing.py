"""Packing tokenized fine-tuning examples into fixed-length training rows with document boundaries.

Every example is one document. A document of n tokens t[0..n) takes n positions of a row: input
t[j] and target t[j+1] where that token carries loss, -100 (ignored) elsewhere, and -100 at its
last position, so no position predicts across a document boundary. An example longer than seq_len
keeps its first seq_len tokens (the rest is dropped, and counted); an example left without any
loss token is dropped (and counted).

With `pack` (the default) documents are packed best-fit: in a seeded order, each goes into the open
row with the least room that still holds it, else starts a new row. A document is never split
across rows. The room left at a row's end is padding: a document of its own whose targets are all
-100. Without `pack`, each example has a row to itself.

The rows are a deterministic function of (examples, seq_len, seed, pack), so every rank builds the
same rows and GlobalSampler's order over them (and so a resume, at any dp) is exact. A batch of
rows carries, besides inputs and targets, each token's position inside its document and the
documents' offsets (cu_seqlens), for attention that stays within documents.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .config import DataConfig
from .sft_data import Example, load_examples

IGNORE_INDEX = -100
PAD_ID = 0  # the padding's input ids: its own document, every target ignored, so any id would do


@dataclass
class PackedBatch:
    """Rows of a batch, everything [batch, seq] but cu_seqlens: inputs, targets (int64), positions
    (restarting at 0 in every document), cu_seqlens (int32 [n_docs + 1]: the documents' offsets in
    the batch-major flattening of [batch, seq]; the last is batch * seq) and max_seqlen (the longest
    document). positions and cu_seqlens are None for rows of one example each (no boundaries needed)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    max_seqlen: int


class PackedRows:
    """Packed rows of seq_len tokens (see the module docstring); sample i is row i."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray, doc_lens: List[np.ndarray],
                 one_example_per_row: bool = False):
        self.seq_len = inputs.shape[1]
        # A row of one example followed by padding needs no document boundaries: under causal attention
        # the example never sees the padding after it, and the padding's outputs carry no loss. Such
        # batches then take the plain batched attention path (cuDNN on GPUs) instead of the varlen one.
        self.one_example_per_row = one_example_per_row
        # inputs and targets side by side, [rows, 2, seq]: `tokens` is then one flat view of both
        self._rows = np.stack([inputs, targets], axis=1).astype(np.int32)
        self._doc_start = np.cumsum([0] + [len(d) for d in doc_lens])  # row r's documents: [start[r], start[r+1])
        self._doc_lens = np.concatenate(doc_lens).astype(np.int64)
        self.loss_tokens_per_row = (self._rows[:, 1] != IGNORE_INDEX).sum(axis=1)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def tokens(self) -> np.ndarray:
        """Every row's inputs and targets, flat (what the job fingerprint digests)."""
        return self._rows.reshape(-1)

    def loss_targets(self) -> np.ndarray:
        """The targets that carry loss, flat (for the unigram entropy)."""
        targets = self._rows[:, 1]
        return targets[targets != IGNORE_INDEX]

    def loss_tokens(self, indices: Sequence[int]) -> int:
        """How many targets of rows `indices` carry loss."""
        return int(self.loss_tokens_per_row[np.asarray(indices, dtype=np.int64)].sum())

    def doc_lens(self, row: int) -> np.ndarray:
        return self._doc_lens[self._doc_start[row]: self._doc_start[row + 1]]

    def batch(self, indices: Sequence[int]) -> PackedBatch:
        rows = torch.from_numpy(self._rows[np.asarray(indices, dtype=np.int64)].astype(np.int64))
        if self.one_example_per_row:
            return PackedBatch(rows[:, 0].contiguous(), rows[:, 1].contiguous(), None, None, self.seq_len)
        lens = [self.doc_lens(int(i)) for i in indices]
        positions = np.concatenate([np.arange(n) for row in lens for n in row]).reshape(len(indices), self.seq_len)
        cu = np.concatenate([[0], np.cumsum(np.concatenate(lens))]).astype(np.int32)
        return PackedBatch(rows[:, 0].contiguous(), rows[:, 1].contiguous(), torch.from_numpy(positions),
                           torch.from_numpy(cu), int(max(int(r.max()) for r in lens)))


def document(example: Example, seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one example, cut to seq_len tokens (see the module docstring)."""
    ids, loss = example.ids[:seq_len], example.loss[:seq_len]
    targets = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    targets[:-1] = np.where(loss[1:], ids[1:], IGNORE_INDEX)
    return ids, targets


def best_fit(lengths: Sequence[int], seq_len: int) -> List[List[int]]:
    """Rows as lists of indices into `lengths`: each length, in order, goes into the row with the
    least room that holds it, else a new row."""
    rows: List[List[int]] = []
    room: List[Tuple[int, int]] = []  # (room left, row) of the rows not yet full, sorted
    for k, n in enumerate(lengths):
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            left, r = room.pop(at)
        else:
            left, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(k)
        if left > n:
            bisect.insort(room, (left - n, r))
    return rows


def pack(docs: Sequence[Tuple[np.ndarray, np.ndarray]], seq_len: int, packed: bool = True) -> PackedRows:
    """Rows of `docs` ((inputs, targets) pairs, each at most seq_len long) in the given order."""
    groups = best_fit([len(ids) for ids, _ in docs], seq_len) if packed else [[k] for k in range(len(docs))]
    inputs = np.full((len(groups), seq_len), PAD_ID, dtype=np.int64)
    targets = np.full((len(groups), seq_len), IGNORE_INDEX, dtype=np.int64)
    doc_lens = []
    for r, group in enumerate(groups):
        lens, at = [], 0
        for k in group:
            ids, tgt = docs[k]
            inputs[r, at: at + len(ids)], targets[r, at: at + len(ids)] = ids, tgt
            lens.append(len(ids))
            at += len(ids)
        if at < seq_len:
            lens.append(seq_len - at)  # the padding, a document of its own
        doc_lens.append(np.asarray(lens))
    return PackedRows(inputs, targets, doc_lens, one_example_per_row=not packed)


def pack_examples(examples: Sequence[Example], seq_len: int, seed: int, eval_fraction: float,
                  packed: bool = True) -> Tuple[PackedRows, Optional[PackedRows], List[str]]:
    """(training rows, held-out rows or None, notes to print): examples cut to seq_len, those left
    without a loss token dropped, the rest shuffled by `seed`, the first `eval_fraction` of them
    (at least one when it is > 0) held out whole, each split packed in that order."""
    docs, cut, dropped = [], 0, []
    for ex in examples:
        ids, targets = document(ex, seq_len)
        cut += len(ex.ids) > seq_len
        if (targets != IGNORE_INDEX).any():
            docs.append((ids, targets))
        else:
            dropped.append(ex.where)
    notes = []
    if cut:
        notes.append(f"{cut} of {len(examples)} examples are longer than seq_len={seq_len} tokens: cut to it")
    if dropped:
        notes.append(f"{len(dropped)} examples have no token that carries loss within seq_len={seq_len} tokens "
                     f"(the completion is empty or cut away), dropped: {', '.join(dropped[:3])}"
                     + (", ..." if len(dropped) > 3 else ""))
    if not docs:
        raise ValueError(f"no example has a token that carries loss within seq_len={seq_len} tokens "
                         f"({len(examples)} examples, e.g. {examples[0].where})")
    # a stream of its own: the sampler's per-epoch permutations use [seed, epoch]
    order = np.random.default_rng([seed, 0x7061636B]).permutation(len(docs))
    n_eval = max(1, int(len(docs) * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= len(docs):
        raise ValueError(f"data.eval_fraction={eval_fraction} holds out all {len(docs)} usable examples")
    held = pack([docs[k] for k in order[:n_eval]], seq_len, packed) if n_eval else None
    train = pack([docs[k] for k in order[n_eval:]], seq_len, packed)
    filled = train.loss_tokens_per_row.sum()
    notes.append(f"{len(docs) - n_eval} train / {n_eval} held-out examples, packed into {len(train)} train / "
                 f"{len(held) if held else 0} held-out rows of {seq_len} tokens; {filled} training tokens carry loss")
    return train, held, notes


def load_packed(cfg: DataConfig, tokenizer, seq_len: int, seed: int) -> Tuple[PackedRows, Optional[PackedRows], List[str]]:
    """The training and held-out rows of data.path's jsonl files (pack_examples), and the notes to print."""
    return pack_examples(load_examples(cfg, tokenizer), seq_len, seed, cfg.eval_fraction, cfg.pack)


def forward_kwargs(batch: PackedBatch, to_device) -> Dict[str, object]:
    """The model's keyword arguments for a packed batch: documents, and losses summed (not averaged)."""
    if batch.cu_seqlens is None:  # one example per row: plain causal attention is exact
        return {"reduction": "sum"}
    return {"position_ids": to_device(batch.positions), "cu_seqlens": to_device(batch.cu_seqlens),
            "max_seqlen": batch.max_seqlen, "reduction": "sum"}
