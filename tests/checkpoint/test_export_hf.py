"""`python -m tpflash.checkpoint export-hf`: a checkpoint written by 2 tp ranks becomes, offline in one
process, a sharded Hugging Face directory whose logits in transformers equal tpflash's (fp32, 1e-4)."""
import os
import subprocess
import sys

import pytest
import torch

import tpflash
from tests.distributed.checks import init_tp
from tpflash.parallel import comm

pytestmark = pytest.mark.cpu_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = dict(vocab_size=101, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64,
             mlp="swiglu", norm="rmsnorm", position="rotary", tie_embeddings=False, bias=False)


def save_body(root, idx):
    """Save a seeded tp=2 Llama-shaped GPT; return its logits on idx (vocabulary gathered)."""
    ps = init_tp(2)
    torch.manual_seed(0)
    model = tpflash.models.GPT(tpflash.models.GPTConfig(**LLAMA)).eval()
    tpflash.checkpoint.save(root, model, step=3)
    with torch.no_grad():
        return comm.all_gather(model(idx), -1, ps.tp_group)[..., :LLAMA["vocab_size"]]


def test_export_hf_cli_gives_transformers_the_same_logits(ranks, tmp_path):
    import transformers
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    idx = torch.randint(0, LLAMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    want = ranks(2).run(save_body, root, idx)[0]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "tpflash.checkpoint", "export-hf", root, out,
                           "--max-shard-size", "20KB"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model.safetensors.index.json" in os.listdir(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (hf(idx).logits - want).abs().max().item() < 1e-4


def test_export_hf_cli_names_a_missing_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tpflash.checkpoint", "export-hf", str(tmp_path / "none"),
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "error:" in done.stderr and "none" in done.stderr
