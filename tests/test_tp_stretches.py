"""benchmarks/tp_stretches.py: a step's stretches cut at its attention kernels, from a chrome trace."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from tp_stretches import blocks_in_step, kernel_starts, stretches, table  # noqa: E402


def _trace(path, kernels):
    """A chrome trace of (name, start us) kernels, plus a CPU op that must be ignored."""
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 1.0} for name, ts in kernels]
    events.append({"ph": "X", "cat": "cpu_op", "name": "flash_fprop (host)", "ts": 0.0, "dur": 1.0})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


# two blocks: forward attention at 10 and 30, the head from 30 to 100, backward attention at 100 and 150,
# the next step's first forward attention at 400
STEP = [("cudnn_flash_fprop", 10.0), ("gemm", 20.0), ("cudnn_flash_fprop", 30.0), ("ce_grad", 60.0),
        ("cudnn_flash_bprop", 100.0), ("cudnn_flash_bprop", 150.0), ("adamw", 300.0), ("cudnn_flash_fprop", 400.0)]


def test_the_step_is_cut_at_the_attention_kernels(tmp_path):
    path = str(tmp_path / "t.json.gz")
    _trace(path, STEP)
    forward, backward = kernel_starts(path, r"flash_fprop"), kernel_starts(path, r"flash_bprop")
    assert forward == [10.0, 30.0, 400.0] and backward == [100.0, 150.0], "kernels only, in order"
    assert blocks_in_step(forward, backward) == 2
    assert stretches(forward, backward, 2) == {"block forward": 20.0, "block backward": 50.0, "head and loss": 70.0,
                                               "tail": 250.0, "step": 390.0}


def test_tp_n_is_set_against_a_tpth_of_tp1():
    one = {"block forward": 200.0, "block backward": 400.0, "head and loss": 100.0, "tail": 50.0, "step": 1000.0}
    half = {name: value / 2 + 10 for name, value in one.items()}
    rows = table(one, half, 2).splitlines()
    assert rows[2] == "| block forward | 100 | 110 | +10 |" and rows[-1] == "| step | 500 | 510 | +10 |"


def test_a_block_count_that_does_not_fit_the_trace_is_refused():
    forward, backward = [10.0, 30.0, 400.0], [100.0, 150.0]
    with pytest.raises(ValueError, match="do not fall into steps of 3 blocks"):
        stretches(forward + [410.0], backward + [420.0], 3)
    with pytest.raises(ValueError, match="need 4 and 3"):
        stretches(forward, backward, 3)
