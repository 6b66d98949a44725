"""Tensor-parallel layers."""
from .attention import KVLinear, ParallelAttention, check_heads
from .block import ParallelTransformerBlock
from .embedding import ColumnParallelEmbedding, VocabParallelEmbedding, padded_vocab_size
from .graphed_blocks import GraphedBlocks
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import ParallelMLP
from .norm import ParallelNorm
from .rotary import RotaryEmbedding

__all__ = ["ColumnParallelEmbedding", "ColumnParallelLinear", "GraphedBlocks", "KVLinear", "ParallelAttention", "ParallelMLP", "ParallelNorm",
           "ParallelTransformerBlock", "RotaryEmbedding", "RowParallelLinear", "VocabParallelEmbedding",
           "check_heads", "padded_vocab_size"]
