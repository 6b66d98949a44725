"""A checkpoint written by 2 tp ranks is readable offline in one CPU process: by PyTorch's own
dcp_to_torch_save (no tpflash), and by `python -m tpflash.checkpoint consolidate` (safetensors + HF dir)."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

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


def _python_fails(*args):
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, (done.stdout, done.stderr[-3000:])
    return done.stderr


def _damaged_copy(step_dir, copy):
    """Copy step_dir and change one byte of one shard (same size: only the sha256 sees it); the shard's name."""
    import shutil
    shutil.copytree(step_dir, copy)
    shard = sorted(n for n in os.listdir(copy) if n.endswith(".distcp"))[0]
    with open(os.path.join(copy, shard), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    return shard


@pytest.fixture(scope="module")
def runs(saved):
    """{name: future of its command's stdout (stderr for a failing one)}, and "damaged shard": every offline
    command the tests check, started together on the saved checkpoints. Each is one process that spends
    most of its time importing torch on one core, so side by side they take about half as long as in a row."""
    base, tiny_root, _, gpt_root, _ = saved
    damaged = str(base / "damaged")
    shard = _damaged_copy(tpflash.checkpoint.latest(tiny_root), damaged)
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {
            "damaged shard": shard,
            "dcp_to_torch_save": pool.submit(
                _python, "-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                               "dcp_to_torch_save(sys.argv[1], sys.argv[2]); assert 'tpflash' not in sys.modules",
                tpflash.checkpoint.latest(tiny_root), str(base / "plain.pt"), cwd=str(base)),
            "consolidate": pool.submit(_python, "-m", "tpflash.checkpoint", "consolidate", tiny_root,
                                       str(base / "tiny.safetensors")),
            "consolidate --hf-dir": pool.submit(_python, "-m", "tpflash.checkpoint", "consolidate", gpt_root,
                                                str(base / "gpt.safetensors"), "--hf-dir", str(base / "hf")),
            "info": pool.submit(_python, "-m", "tpflash.checkpoint", "info", tiny_root),
            "info damaged": pool.submit(_python_fails, "-m", "tpflash.checkpoint", "info", damaged),
            "info damaged --no-verify": pool.submit(_python, "-m", "tpflash.checkpoint", "info", damaged,
                                                    "--no-verify"),
        }


def test_dcp_to_torch_save_reads_the_checkpoint_without_tpflash(saved, runs):
    base, _, tiny_full, _, _ = saved
    runs["dcp_to_torch_save"].result()
    plain = torch.load(str(base / "plain.pt"), weights_only=False)
    for key, value in tiny_full.items():
        assert torch.equal(plain[f"model.{key}"], value), key
    assert plain["optim.state.embed.weight.exp_avg"].shape == tiny_full["embed.weight"].shape


def test_consolidate_cli_writes_one_unsharded_safetensors_file(saved, runs):
    base, _, tiny_full, _, _ = saved
    runs["consolidate"].result()
    from safetensors.torch import load_file
    tensors = load_file(str(base / "tiny.safetensors"))
    assert tensors.keys() == tiny_full.keys()
    for key, value in tiny_full.items():
        assert torch.equal(tensors[key], value), key


def test_consolidate_cli_writes_a_hugging_face_model_dir(saved, runs):
    base, _, _, _, gpt_full = saved
    runs["consolidate --hf-dir"].result()
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base / "hf"))
    assert hf.config.vocab_size == GPT_CONFIG["vocab_size"]
    wte = hf.get_input_embeddings().weight
    assert torch.equal(wte, gpt_full["tok_embeddings.weight"])


def test_info_cli_describes_a_checkpoint_saved_at_tp2(saved, runs):
    _, _, tiny_full, _, _ = saved
    out = runs["info"].result()
    values = sum(v.numel() for v in tiny_full.values())
    assert "step 1" in out and "saved at tp=2 cp=1 dp=1 (world 2)" in out
    assert f"{len(tiny_full)} tensors, {values:,} values; optimizer state" in out
    assert "every file's sha256 matches its manifest" in out


def test_info_cli_exits_1_naming_a_damaged_file(runs):
    assert f"file {runs['damaged shard']} fails its sha256 checksum" in runs["info damaged"].result()
    assert "checksums not read" in runs["info damaged --no-verify"].result()
