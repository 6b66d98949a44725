"""tpflash: tensor-parallel, sequence-parallel and FSDP training of transformers over fused Triton kernels."""
from . import checkpoint, kernels, layers, losses, models, parallel

__version__ = "0.1.0"
__all__ = ["checkpoint", "kernels", "layers", "losses", "models", "parallel"]
