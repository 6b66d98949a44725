"""Losses over vocabulary-parallel logits."""
from .cross_entropy import vocab_parallel_cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy", "vocab_parallel_cross_entropy"]
