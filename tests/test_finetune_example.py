"""scripts/finetune_example.sh runs end to end on 2 CPU ranks (20 of its 60 steps): the exported Hugging
Face model reloads in transformers with tpflash's logits (the script asserts 1e-4 itself and prints the gap)."""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="the script's torchrun run needs Linux here")
def test_finetune_example_exports_a_model_transformers_reloads_with_the_same_logits(tmp_path):
    env = dict(os.environ, TPFLASH_FINETUNE_DIR=str(tmp_path / "run"), TPFLASH_FINETUNE_STEPS="20")
    done = subprocess.run(["bash", "scripts/finetune_example.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    gap = re.search(r"max \|logits\(transformers\) - logits\(tpflash\)\| = ([0-9.e+-]+)", done.stdout)
    assert gap and float(gap.group(1)) < 1e-4, done.stdout[-2000:]
    assert (tmp_path / "run" / "hf" / "config.json").exists()
