"""Memory proof of the streaming Hugging Face load and export, on a random bf16 Llama of ~350 MiB
saved by transformers in 4 safetensors shards.

- from_pretrained on 4 CPU ranks, at FSDP dp=4 tp=1, FSDP dp=2 tp=2 and tp=4 without FSDP: each
  rank's peak private memory (RssAnon) grows by at most 0.35 x the model (its quarter, ~0.25,
  plus one slice in flight), and the loaded tensors equal the files' exactly.
- save_pretrained from FSDP dp=2 tp=2 and the offline `export-hf` of a checkpoint of it: the
  writing process grows by at most one shard file (max_shard_size = 1/4 of the model) + 20%,
  and both outputs hold exactly the original tensors under transformers' names.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.rss import PeakRss
from tests.distributed.checks import init_tp
from tpflash.models import from_pretrained, save_pretrained

pytestmark = pytest.mark.cpu_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=10,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """(directory, model bytes): a random bf16 LlamaForCausalLM (untied, GQA) saved in 4 shards."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: no fp32 copy of the model
    try:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **SHAPE))
    finally:
        torch.set_default_dtype(saved)
    directory = str(tmp_path_factory.mktemp("llama350m"))
    model.save_pretrained(directory, max_shard_size="100MB")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert nbytes > 300 * 2**20 and len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) >= 4
    return directory, nbytes


def _reference(hf_dir):
    """{HF name: tensor} for a few tensors, each a view of the mapped file (no private memory)."""
    from safetensors import safe_open
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
             "model.layers.3.self_attn.k_proj.weight", "model.layers.3.self_attn.o_proj.weight",
             "model.layers.9.mlp.down_proj.weight", "model.layers.9.mlp.gate_proj.weight"]
    out = {}
    for name in names:
        with safe_open(os.path.join(hf_dir, weight_map[name]), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _mismatches(model, hf_dir):
    """Names of checked tensors whose loaded (gathered) values differ from the files'."""
    from tpflash.parallel import full_state_dict
    ref = _reference(hf_dir)
    full = {}
    for prefix, module in [("model.embed_tokens.", model.tok_embeddings), ("lm_head.", model.lm_head),
                           ("model.norm.", model.final_norm), ("model.layers.3.", model.blocks[3]),
                           ("model.layers.9.", model.blocks[9])]:
        for key, value in full_state_dict(module).items():  # collective: every rank, same order
            full[prefix + key.replace("attn.", "self_attn.")] = value
    return [name for name, want in ref.items() if not torch.equal(full[name], want)]


def _warm_up(ps):
    """Use FSDP once on a tiny model: its first use in a process imports and builds ~30 MiB of state
    that is not part of any load."""
    from tpflash.models import GPTConfig
    from tpflash.models.pretrained import build_on_meta
    from tpflash.parallel import apply_fsdp
    apply_fsdp(build_on_meta(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16)), ps)


def load_body(hf_dir, tp, fsdp):
    """(peak RssAnon growth while loading, peak RssFile growth, mismatching tensors) on this rank."""
    _warm_up(init_tp(tp))
    with PeakRss() as rss:
        model = from_pretrained(hf_dir, fsdp=fsdp)
    bad = _mismatches(model, hf_dir)
    del model
    return rss.anon_growth, rss.file_growth, bad


@pytest.mark.parametrize("tp,fsdp", [(1, True), (2, True), (4, False)], ids=["fsdp-dp4", "fsdp-dp2-tp2", "tp4"])
def test_each_rank_loads_only_its_shard(ranks, llama_dir, tp, fsdp):
    hf_dir, nbytes = llama_dir
    for rank, (anon, file, bad) in enumerate(ranks(4).run(load_body, hf_dir, tp, fsdp)):
        print(f"tp={tp} fsdp={fsdp} rank {rank}: RssAnon +{anon / 2**20:.0f} MiB ({anon / nbytes:.2f} x model "
              f"{nbytes / 2**20:.0f} MiB), file pages +{file / 2**20:.0f} MiB")
        assert not bad, f"rank {rank}: loaded tensors differ from the files: {bad}"
        assert anon <= 0.35 * nbytes, f"rank {rank}: RssAnon grew {anon / 2**20:.0f} MiB > 0.35 x the model"


def export_body(hf_dir, out_dir, ckpt_root, max_bytes):
    """Rank 0's peak RssAnon growth while save_pretrained writes; then a tpflash checkpoint of the model."""
    import tpflash
    init_tp(2)
    model = from_pretrained(hf_dir, fsdp=True)
    with PeakRss() as rss:
        save_pretrained(model, out_dir, max_shard_size=max_bytes, tokenizer_from=hf_dir)
    tpflash.checkpoint.save(ckpt_root, model, step=0)
    del model
    return rss.anon_growth


_OFFLINE = """
import sys
from benchmarks.rss import PeakRss
from tpflash.checkpoint.export_hf import export_hf
export_hf(sys.argv[1], sys.argv[2] + "-warm-up", max_shard_size=int(sys.argv[3]))  # lazy imports: ~30 MiB once
with PeakRss() as rss:
    export_hf(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
print(rss.anon_growth)
"""


def _same_tensors(a_dir, b_dir):
    """Every tensor of a_dir's files equals b_dir's (read one at a time); the same names."""
    from safetensors import safe_open
    maps = []
    for d in (a_dir, b_dir):
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            maps.append(json.load(f)["weight_map"])
    assert maps[0].keys() == maps[1].keys()
    for name in maps[0]:
        with safe_open(os.path.join(a_dir, maps[0][name]), "pt") as fa, \
                safe_open(os.path.join(b_dir, maps[1][name]), "pt") as fb:
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name)), name


def test_export_holds_one_shard_at_most(ranks, llama_dir, tmp_path):
    hf_dir, nbytes = llama_dir
    max_bytes = nbytes // 4
    out, ckpt, offline = str(tmp_path / "out"), str(tmp_path / "ckpt"), str(tmp_path / "offline")
    online = ranks(4).run(export_body, hf_dir, out, ckpt, max_bytes)[0]
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _OFFLINE, ckpt, offline, str(max_bytes)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    offline_growth = int(done.stdout.split()[-1])
    for what, growth in [("save_pretrained rank 0", online), ("export-hf", offline_growth)]:
        print(f"{what}: RssAnon +{growth / 2**20:.0f} MiB, max_shard_size {max_bytes / 2**20:.0f} MiB")
        assert growth <= 1.2 * max_bytes, f"{what} grew {growth / 2**20:.0f} MiB > one shard + 20%"
    for d in (out, offline):
        assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) >= 4
        _same_tensors(hf_dir, d)
