"""Tensor-parallel layers."""
from .embedding import VocabParallelEmbedding, padded_vocab_size
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "padded_vocab_size"]
