"""Sharded checkpoints over torch.distributed.checkpoint."""
