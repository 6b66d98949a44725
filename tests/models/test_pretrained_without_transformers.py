"""from_pretrained and save_pretrained need safetensors and config.json only: with `import transformers`
failing (as where it is not installed), a Llama-family model round-trips through a Hugging Face
directory exactly."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import sys

    class _NoTransformers:
        def find_spec(self, name, path=None, target=None):
            if name == "transformers" or name.startswith("transformers."):
                raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
            return None

    sys.meta_path.insert(0, _NoTransformers())
    import torch
    from tpflash.models import GPT, GPTConfig, from_pretrained, save_pretrained

    torch.manual_seed(0)
    cfg = GPTConfig.preset("llama-tiny", vocab_size=61, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                           ffn_hidden=64, qkv_bias=True, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    model = GPT(cfg)
    save_pretrained(model, sys.argv[1], max_shard_size="8KB")
    again = from_pretrained(sys.argv[1])
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "tensors changed"
    assert again.config == model.config, (again.config, model.config)
    assert "transformers" not in sys.modules
    print("ok", len(a))
""")


def test_round_trip_through_files_without_transformers(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "hf")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
