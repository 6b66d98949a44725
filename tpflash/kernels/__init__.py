"""Fused kernels (Triton on CUDA), each beside a plain-PyTorch reference. Knows nothing of process groups."""
