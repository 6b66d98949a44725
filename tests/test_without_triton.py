"""A CPU install without Triton: the package imports and its CPU paths (the references) run."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Makes `import triton` fail in the child, as on a machine where it is not installed.
BLOCK_TRITON = textwrap.dedent("""
    import sys

    class _NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError("No module named 'triton'", name="triton")
            return None

    sys.meta_path.insert(0, _NoTriton())
""")

CHILD = textwrap.dedent("""
    import sys
    import torch
    import tpflash
    from tpflash.kernels import flash_attention, layer_norm, use_backend
    from tpflash.losses import vocab_parallel_cross_entropy
    from tpflash.models import GPT, GPTConfig
    from tpflash.train.cli import main

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    idx = torch.randint(0, 64, (2, 16))
    logits = model(idx)
    vocab_parallel_cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    q = torch.randn(1, 2, 8, 16)
    flash_attention(q, q, q, causal=True)
    layer_norm(torch.randn(4, 8), torch.ones(8))
    try:
        with use_backend("triton"):
            layer_norm(torch.randn(4, 8), torch.ones(8))
    except ValueError as e:
        assert "Triton is not installed" in str(e), e
    else:
        raise AssertionError("forcing triton without Triton did not fail")
    assert main(["--config", "demo", "--tp=1", "--print-config"]) == 0
    assert "triton" not in sys.modules
    print("ok")
""")


def test_tpflash_imports_and_runs_on_cpu_without_triton(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_TRITON)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), TRITON_INTERPRET="0",
               TPFLASH_KERNELS="auto", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
