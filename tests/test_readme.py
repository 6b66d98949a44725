"""The README's "As a library" snippet runs as written: on 2 gloo ranks and in one process, same loss."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = re.compile(r"tp rank (\d+) of (\d+): loss ([0-9.]+)")


def library_snippet() -> str:
    """The first ```python block under the README's "## As a library" heading."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("\n## As a library\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no ```python block under '## As a library' in README.md"
    return match.group(1)


def _run_snippet_on_rank(code: str):
    """Rank body: exec the snippet in the pool's process. The pool keeps its process group for later
    tests, so the snippet's closing shutdown() only clears the default state here."""
    import torch

    import tpflash.parallel
    from tpflash.parallel.state import set_default_state

    calls = []
    real_shutdown = tpflash.parallel.shutdown
    tpflash.parallel.shutdown = lambda: (calls.append(1), set_default_state(None))
    namespace = {"__name__": "__readme__"}
    try:
        exec(compile(code, "README.md", "exec"), namespace)
    finally:
        tpflash.parallel.shutdown = real_shutdown
        torch.set_default_device(None)
    assert calls == [1], "the snippet must end with tpflash.parallel.shutdown()"
    full = namespace["full"]
    assert full["weight"].shape == (256, 64) and full["bias"].shape == (256,)
    assert namespace["y_sp"].shape == (8, 2, 64)  # [seq/tp, batch, hidden]
    return namespace["loss"].item()


@pytest.mark.cpu_ranks
def test_readme_library_snippet_runs_as_written(ranks):
    code = library_snippet()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items()
                              if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
    assert out.returncode == 0, out.stderr
    found = LOSS.findall(out.stdout)
    assert [(r, n) for r, n, _ in found] == [("0", "1")], out.stdout
    single = float(found[0][2])

    losses = ranks(2).run(_run_snippet_on_rank, code)
    assert losses[0] == losses[1]
    assert losses[0] == pytest.approx(single, rel=1e-5, abs=1e-5)
