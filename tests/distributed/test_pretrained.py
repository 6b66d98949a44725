"""from_pretrained / save_pretrained on tiny fp32 models (vocabulary 101: padded at tp 2 and 4):

- from_pretrained gives transformers' logits (1e-4) at tp 1 and 2, and under FSDP at dp=2 x tp=2;
- save_pretrained's directory loads in transformers with the same logits, and
  from_pretrained(save_pretrained(from_pretrained(d))) holds exactly the same tensors
  (GPT-2: tied, Conv1D transposes, fused q|k|v; Llama: tied and untied);
- GPT-2 files without the "transformer." prefix load; bad directories raise one clear ValueError.
"""
import json
import os

import pytest
import torch

from tests.distributed.checks import init_tp
from tests.distributed.test_hf import VOCAB, tiny_hf
from tpflash.models import from_pretrained, save_pretrained
from tpflash.parallel import comm, full_state_dict

pytestmark = pytest.mark.cpu_ranks

SEQ = 8


def _save_hf(family, tied, directory):
    """A tiny random HF model saved in several shards; returns (directory, ids, its logits)."""
    hf = tiny_hf(family, tied)
    hf.save_pretrained(directory, max_shard_size="20KB")
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        return directory, idx, hf(idx).logits


def round_trip_body(hf_dir, out_dir, idx, want, tp, fsdp):
    """(max |logits - HF logits|, whether the re-loaded export holds the same tensors)."""
    ps = init_tp(tp) if tp > 1 or fsdp else None
    model = from_pretrained(hf_dir, fsdp=fsdp).eval()
    with torch.no_grad():
        logits = comm.all_gather(model(idx), -1, ps.tp_group if ps else None)[..., :VOCAB]
    save_pretrained(model, out_dir, max_shard_size="16KB", tokenizer_from=hf_dir)
    again = from_pretrained(out_dir, fsdp=fsdp)
    a, b = full_state_dict(model), full_state_dict(again)
    return (logits - want).abs().max().item(), a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


CASES = [("gpt2", True, 1, False), ("gpt2", True, 2, False), ("llama", False, 1, False), ("llama", False, 2, False),
         ("llama", True, 2, False), ("gpt2", True, 2, True), ("llama", False, 2, True)]


@pytest.mark.parametrize("family,tied,tp,fsdp", CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}-tp{tp}{'-fsdp-dp2' if s else ''}" for f, t, tp, s in CASES])
def test_round_trip_through_files(ranks, tmp_path, family, tied, tp, fsdp):
    import transformers
    hf_dir, idx, want = _save_hf(family, tied, str(tmp_path / "hf"))
    out = str(tmp_path / "out")
    world = tp * (2 if fsdp else 1)
    for gap, same in ranks(world).run(round_trip_body, hf_dir, out, idx, want, tp, fsdp):
        assert gap < 1e-4, f"max |logits - HF logits| = {gap:.3g}"
        assert same, "from_pretrained(save_pretrained(model)) changed a tensor"
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "config.json" in files and "generation_config.json" in files
    if tied:
        with open(os.path.join(out, "model.safetensors.index.json")) as f:
            assert "lm_head.weight" not in json.load(f)["weight_map"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (back(idx).logits - want).abs().max().item() < 1e-4


def _rewrite(path, change):
    """Rewrite safetensors file `path` with change({name: tensor}) applied."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path)
    save_file(change(tensors), path, metadata={"format": "pt"})


def test_gpt2_names_without_the_transformer_prefix_load(tmp_path):
    hf_dir, idx, want = _save_hf("gpt2", True, str(tmp_path))
    for name in os.listdir(hf_dir):
        if name.endswith(".safetensors"):
            _rewrite(os.path.join(hf_dir, name), lambda t: {k.removeprefix("transformer."): v for k, v in t.items()})
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    data["weight_map"] = {k.removeprefix("transformer."): v for k, v in data["weight_map"].items()}
    with open(index, "w") as f:
        json.dump(data, f)
    with torch.no_grad():
        got = from_pretrained(hf_dir).eval()(idx)[..., :VOCAB]
    assert (got - want).abs().max().item() < 1e-4


def test_bad_directories_raise_one_clear_error(tmp_path):
    hf_dir, _, _ = _save_hf("llama", False, str(tmp_path / "hf"))
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    with pytest.raises(ValueError, match="has no config.json"):
        from_pretrained(str(tmp_path))
    config_path = os.path.join(hf_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "intermediate_size": 96}, f)
    with pytest.raises(ValueError, match=r"model-\d+-of-\d+.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' "
                                         r"has shape \(64, 32\), the model expects \(96, 32\)"):
        from_pretrained(hf_dir)
    with open(config_path, "w") as f:
        json.dump({**config, "model_type": "bert"}, f)
    with pytest.raises(ValueError, match="model_type='bert' is not supported"):
        from_pretrained(hf_dir)
    with open(config_path, "w") as f:
        json.dump(config, f)
    name = "model.layers.1.self_attn.v_proj.weight"
    _rewrite(os.path.join(hf_dir, weight_map[name]), lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ValueError, match=f"tensor '{name}' .tpflash blocks.1.attn.v_proj.weight. is in none of"):
        from_pretrained(hf_dir)
    os.remove(os.path.join(hf_dir, weight_map[name]))
    with pytest.raises(ValueError, match="model.safetensors.index.json names files that are not there"):
        from_pretrained(hf_dir)


def test_export_rejects_bad_arguments(tmp_path):
    hf_dir, _, _ = _save_hf("gpt2", True, str(tmp_path / "hf"))
    model = from_pretrained(hf_dir)
    with pytest.raises(ValueError, match="max_shard_size='5 parsecs' must be bytes or a size"):
        save_pretrained(model, str(tmp_path / "out"), max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match="tokenizer_from=.* is not a directory"):
        save_pretrained(model, str(tmp_path / "out"), tokenizer_from=str(tmp_path / "nothing"))
    save_pretrained(model, str(tmp_path / "out"))  # one file: below 5GB
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]
