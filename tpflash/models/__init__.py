"""GPT/Llama models built from tpflash.layers, and Hugging Face import/export (transformers is
imported only when from_hf/to_hf are called)."""
from .config import PRESETS, GPTConfig
from .gpt import GPT


def from_hf(hf_model, process_group=None, sequence_parallel=False, **overrides):
    """See tpflash.models.hf.from_hf."""
    from .hf import from_hf as _from_hf
    return _from_hf(hf_model, process_group=process_group, sequence_parallel=sequence_parallel, **overrides)


def to_hf(model):
    """See tpflash.models.hf.to_hf."""
    from .hf import to_hf as _to_hf
    return _to_hf(model)


__all__ = ["GPT", "GPTConfig", "PRESETS", "from_hf", "to_hf"]
