"""The training entry point (torchrun -m tpflash.train)."""
