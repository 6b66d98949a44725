"""Losses over vocabulary-parallel logits."""
from .cross_entropy import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]
