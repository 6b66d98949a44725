"""GPT/Llama models built from tpflash.layers, and Hugging Face import/export (transformers is
imported only when from_hf/to_hf are called; from_pretrained/save_pretrained never import it)."""
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


def from_pretrained(hf_dir, process_group=None, sequence_parallel=False, fsdp=False, dtype=None, device=None,
                    **overrides):
    """See tpflash.models.pretrained.from_pretrained (streams each rank's slices from safetensors files)."""
    from .pretrained import from_pretrained as _from_pretrained
    return _from_pretrained(hf_dir, process_group=process_group, sequence_parallel=sequence_parallel, fsdp=fsdp,
                            dtype=dtype, device=device, **overrides)


def save_pretrained(model, out_dir, max_shard_size="5GB", tokenizer_from=None, dtype=None):
    """See tpflash.models.pretrained_save.save_pretrained (collective; streams tensors into sharded files)."""
    from .pretrained_save import save_pretrained as _save_pretrained
    return _save_pretrained(model, out_dir, max_shard_size=max_shard_size, tokenizer_from=tokenizer_from,
                            dtype=dtype)


__all__ = ["GPT", "GPTConfig", "PRESETS", "from_hf", "from_pretrained", "save_pretrained", "to_hf"]
