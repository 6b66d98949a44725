"""Tensor-parallel embeddings: the table's rows (vocabulary) or columns (embedding features) split over tp."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel import comm, peer_embedding
from ..parallel.sharding import ShardSpec, take_shards
from ..parallel.state import group_rank, group_size, resolve_tp_group


def padded_vocab_size(num_embeddings: int, tp: int) -> int:
    """The vocabulary padded to a multiple of tp (each rank holds padded/tp rows)."""
    return math.ceil(num_embeddings / tp) * tp


def _initial_table(num_embeddings: int, embedding_dim: int, padding_idx: Optional[int],
                   init_method: Optional[Callable], device, dtype) -> torch.Tensor:
    """The unsharded [num_embeddings, embedding_dim] table nn.Embedding would draw for the same RNG state
    (padding row zeroed); each rank keeps its shard of it."""
    full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
    (init_method or nn.init.normal_)(full)
    if padding_idx is not None:
        with torch.no_grad():
            full[padding_idx].zero_()
    return full


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding(num_embeddings, embedding_dim) with rows split over tp.

    The vocabulary is padded to a multiple of tp; rank r holds rows [r*V'/tp, (r+1)*V'/tp) of
    the padded table (V' = padded size). Padding rows are zero, receive no gradient and never
    appear in `full_state_dict` (whose "weight" is [num_embeddings, embedding_dim]).
    Input ids: [*] (replicated over tp). Output: [*, embedding_dim], summed over tp; with
    sequence_parallel, reduce-scattered along `seq_dim` ([seq, batch] ids give [seq/tp, batch, dim]);
    there, along dim 0 where the GPUs of the group map each other's memory, each rank instead writes
    the rows it owns straight to the rank holding their positions (tpflash.parallel.peer_embedding:
    the same bits, a quarter of the traffic at tp=4).
    `check_ids` (default: on for CPU tensors, where the check costs no device sync) raises on ids
    outside [0, num_embeddings).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 process_group=None, *, sequence_parallel: bool = False, seq_dim: int = 0,
                 check_ids: Optional[bool] = None, init_method: Optional[Callable] = None,
                 device=None, dtype=None):
        super().__init__()
        if num_embeddings < 1:
            raise ValueError(f"num_embeddings={num_embeddings} must be >= 1")
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} is outside [0, {num_embeddings})")
        self.process_group = resolve_tp_group(process_group)
        tp, rank = group_size(self.process_group), group_rank(self.process_group)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, tp)
        self.rows_per_rank = self.num_embeddings_padded // tp
        self.vocab_start = rank * self.rows_per_rank  # first padded row held here
        self.sequence_parallel, self.seq_dim, self.check_ids = sequence_parallel, seq_dim, check_ids
        self.tp_shard_specs = {"weight": ShardSpec(0, num_embeddings)}
        full = _initial_table(num_embeddings, embedding_dim, padding_idx, init_method, device, dtype)
        self.weight = nn.Parameter(self.tp_shard_specs["weight"].shard(full, rank, tp))
        local_pad = None if padding_idx is None else padding_idx - self.vocab_start
        self._local_padding_idx = local_pad if local_pad is not None and 0 <= local_pad < self.rows_per_rank else None

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> "VocabParallelEmbedding":
        """The vocabulary-parallel form of an existing nn.Embedding: this rank keeps its (padded) rows
        of embedding's table, with no new initialisation. kwargs: the constructor's options
        (process_group, sequence_parallel, seq_dim, check_ids)."""
        _check_plain(embedding)
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, device="meta",
                    dtype=embedding.weight.dtype, **kwargs)
        take_shards(layer, {"weight": embedding.weight})
        return layer

    def _validate(self, ids: torch.Tensor) -> None:
        check = self.check_ids if self.check_ids is not None else ids.device.type == "cpu"
        if check and ids.numel() > 0:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside [0, num_embeddings={self.num_embeddings})")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._validate(ids)
        tp = group_size(self.process_group)
        if (self.sequence_parallel and self.seq_dim == 0 and tp > 1 and ids.shape[0] % tp == 0
                and peer_embedding.reaches(self.weight, self.process_group)):
            return peer_embedding.vocab_lookup(ids, self.weight, self.vocab_start, self.num_embeddings_padded,
                                               self._local_padding_idx, self.process_group)
        if tp == 1:
            out = F.embedding(ids, self.weight, self._local_padding_idx)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.rows_per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight, self._local_padding_idx)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # [*, dim], this rank's rows only
        if self.sequence_parallel:
            return comm.reduce_scatter_along_seq(out, self.process_group, self.seq_dim)
        return comm.reduce_from_tp_region(out, self.process_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, padded={self.num_embeddings_padded}, "
                f"tp={group_size(self.process_group)}")


def _check_plain(embedding: nn.Embedding) -> None:
    """ValueError for nn.Embedding options the parallel embeddings do not implement."""
    unsupported = [name for name, value in (("max_norm", embedding.max_norm), ("sparse", embedding.sparse),
                                            ("scale_grad_by_freq", embedding.scale_grad_by_freq)) if value]
    if unsupported:
        raise ValueError(f"nn.Embedding with {', '.join(unsupported)} has no tensor-parallel form")


class ColumnParallelEmbedding(nn.Module):
    """nn.Embedding(num_embeddings, embedding_dim) with the embedding features (columns) split over tp.

    Rank r holds columns [r*c, (r+1)*c) of the table, c = ceil(embedding_dim/tp), the last rank(s)
    zero-padded. Input ids: [*] (replicated over tp). Output: [*, embedding_dim], all-gathered over
    tp (the padding columns stripped); with sequence_parallel, this rank's chunk along `seq_dim`.
    Process group: `process_group`, else the default state's tp group, else none (tp=1).
    Built from an existing table by `from_embedding` (the tensor-parallel `parallelize` uses it).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 process_group=None, *, sequence_parallel: bool = False, seq_dim: int = 0,
                 init_method: Optional[Callable] = None, device=None, dtype=None):
        super().__init__()
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx={padding_idx} is outside [0, {num_embeddings})")
        self.process_group = resolve_tp_group(process_group)
        tp, rank = group_size(self.process_group), group_rank(self.process_group)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        self.tp_shard_specs = {"weight": ShardSpec(1, embedding_dim)}
        full = _initial_table(num_embeddings, embedding_dim, padding_idx, init_method, device, dtype)
        self.weight = nn.Parameter(self.tp_shard_specs["weight"].shard(full, rank, tp))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> "ColumnParallelEmbedding":
        """The column-parallel form of an existing nn.Embedding: this rank keeps its (padded) columns
        of embedding's table, with no new initialisation. kwargs: the constructor's options
        (process_group, sequence_parallel, seq_dim)."""
        _check_plain(embedding)
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx, device="meta",
                    dtype=embedding.weight.dtype, **kwargs)
        take_shards(layer, {"weight": embedding.weight})
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight, self.padding_idx)  # [*, c]
        if group_size(self.process_group) == 1:
            return out
        # gather's backward keeps this rank's columns of the (replicated) gradient; the narrow's gives the
        # padding columns a zero gradient, so they stay zero
        out = comm.gather_along_dim(out, -1, self.process_group).narrow(-1, 0, self.embedding_dim)
        if self.sequence_parallel:
            out = comm.split_along_dim(out, self.seq_dim, self.process_group)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={group_size(self.process_group)}, columns split"
