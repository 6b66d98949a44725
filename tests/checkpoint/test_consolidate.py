"""A checkpoint written by 2 tp ranks is readable offline in one CPU process: by PyTorch's own
dcp_to_torch_save (no tpflash), and by `python -m tpflash.checkpoint consolidate` (safetensors + HF dir)."""
import os
import subprocess
import sys

import pytest
import torch

import tpflash
from tests.checkpoint.tiny_model import build, make_optimizer, train
from tests.distributed.checks import init_tp
from tpflash.parallel import full_state_dict

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT_CONFIG = dict(vocab_size=61, block_size=8, n_layer=1, n_head=2, n_embd=16)  # 61: padded at tp=2


def save_body(tiny_root, gpt_root):
    ps = init_tp(2)
    model = build(seed=0)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(1), ps.dp_rank, ps.dp_size)
    tpflash.checkpoint.save(tiny_root, model, optimizer, step=1)
    torch.manual_seed(0)
    gpt = tpflash.models.GPT(tpflash.models.GPTConfig(**GPT_CONFIG))
    tpflash.checkpoint.save(gpt_root, gpt, step=0)
    return full_state_dict(model), full_state_dict(gpt)


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    base = tmp_path_factory.mktemp("consolidate")
    tiny_root, gpt_root = str(base / "tiny"), str(base / "gpt")
    tiny_full, gpt_full = ranks(2).run(save_body, tiny_root, gpt_root)[0]
    return base, tiny_root, tiny_full, gpt_root, gpt_full


def _python(*args, cwd=REPO):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_dcp_to_torch_save_reads_the_checkpoint_without_tpflash(saved):
    base, tiny_root, tiny_full, _, _ = saved
    out = str(base / "plain.pt")
    step_dir = tpflash.checkpoint.latest(tiny_root)
    _python("-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                  "dcp_to_torch_save(sys.argv[1], sys.argv[2]); assert 'tpflash' not in sys.modules",
            step_dir, out, cwd=str(base))
    plain = torch.load(out, weights_only=False)
    for key, value in tiny_full.items():
        assert torch.equal(plain[f"model.{key}"], value), key
    assert plain["optim.state.embed.weight.exp_avg"].shape == tiny_full["embed.weight"].shape


def test_consolidate_cli_writes_one_unsharded_safetensors_file(saved):
    base, tiny_root, tiny_full, _, _ = saved
    out = str(base / "tiny.safetensors")
    _python("-m", "tpflash.checkpoint", "consolidate", tiny_root, out)
    from safetensors.torch import load_file
    tensors = load_file(out)
    assert tensors.keys() == tiny_full.keys()
    for key, value in tiny_full.items():
        assert torch.equal(tensors[key], value), key


def test_consolidate_cli_writes_a_hugging_face_model_dir(saved):
    base, _, _, gpt_root, gpt_full = saved
    out, hf_dir = str(base / "gpt.safetensors"), str(base / "hf")
    _python("-m", "tpflash.checkpoint", "consolidate", gpt_root, out, "--hf-dir", hf_dir)
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    assert hf.config.vocab_size == GPT_CONFIG["vocab_size"]
    wte = hf.get_input_embeddings().weight
    assert torch.equal(wte, gpt_full["tok_embeddings.weight"])


def _python_fails(*args):
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    return done.stderr


def test_info_cli_describes_a_checkpoint_saved_at_tp2(saved):
    _, tiny_root, tiny_full, _, _ = saved
    out = _python("-m", "tpflash.checkpoint", "info", tiny_root)
    values = sum(v.numel() for v in tiny_full.values())
    assert "step 1" in out and "saved at tp=2 cp=1 dp=1 (world 2)" in out
    assert f"{len(tiny_full)} tensors, {values:,} values; optimizer state" in out
    assert "every file's sha256 matches its manifest" in out


def test_info_cli_exits_1_naming_a_damaged_file(saved, tmp_path):
    import shutil
    _, tiny_root, _, _, _ = saved
    copy = str(tmp_path / "copy")
    shutil.copytree(tpflash.checkpoint.latest(tiny_root), copy)
    shard = sorted(n for n in os.listdir(copy) if n.endswith(".distcp"))[0]
    with open(os.path.join(copy, shard), "r+b") as f:  # same size, one byte changed: only the sha256 sees it
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    assert f"file {shard} fails its sha256 checksum" in _python_fails("-m", "tpflash.checkpoint", "info", copy)
    assert "checksums not read" in _python("-m", "tpflash.checkpoint", "info", copy, "--no-verify")
