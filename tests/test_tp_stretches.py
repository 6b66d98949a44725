"""benchmarks/tp_stretches.py: a step's stretches cut at its attention kernels, from a chrome trace."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from tp_stretches import (blocks_in_step, busy, kernel_starts, kernel_table, kernel_times, load_kernels,  # noqa: E402
                          stretches, table, windows)


def _trace(path, kernels):
    """A chrome trace of (name, start us[, duration us]) kernels (1 us by default), plus a CPU op that must
    be ignored."""
    events = [{"ph": "X", "cat": "kernel", "name": k[0], "ts": k[1], "dur": k[2] if len(k) > 2 else 1.0}
              for k in kernels]
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


def test_the_gemms_time_is_summed_per_stretch_and_averaged_over_the_blocks(tmp_path):
    path = str(tmp_path / "t.json.gz")
    # GEMMs: 5 us in the first block's forward, 4 in the head, 3 + 7 in the backward's one block window,
    # 6 in the tail; a kernel of another name is not counted
    _trace(path, STEP + [("nvjet_a", 12.0, 5.0), ("nvjet_b", 40.0, 4.0), ("cutlass_c", 110.0, 3.0),
                         ("nvjet_d", 120.0, 7.0), ("nvjet_e", 200.0, 6.0), ("copy", 15.0, 50.0)])
    kernels = load_kernels(path)
    forward, backward = kernel_starts(path, r"flash_fprop"), kernel_starts(path, r"flash_bprop")
    spans = windows(forward, backward, 2)
    gemms = {name: busy(kernels, spans[name], r"nvjet|cutlass") for name in spans}
    assert gemms == {"block forward": 5.0, "block backward": 10.0, "head and loss": 4.0, "tail": 6.0, "step": 25.0}


def test_the_gemm_columns_set_tp_n_against_a_tpth_of_tp1():
    one = {"block forward": 200.0, "block backward": 400.0, "head and loss": 100.0, "tail": 50.0, "step": 1000.0}
    half = {name: value / 2 + 10 for name, value in one.items()}
    gemm_one = {name: value / 2 for name, value in one.items()}
    gemm_half = {name: value / 4 + 5 for name, value in one.items()}
    rows = table(one, half, 2, (gemm_one, gemm_half)).splitlines()
    assert rows[0].endswith("| GEMMs, 1/2 of tp=1 | tp=2 | over |")
    assert rows[2] == "| block forward | 100 | 110 | +10 | 50 | 55 | +5 |"


def test_the_kernels_time_in_the_step_is_summed_by_name_with_digits_folded_and_gemms_left_out(tmp_path):
    path = str(tmp_path / "t.json.gz")
    # in the step (10 to 400): two launches of one kernel at two tile sizes, a GEMM; after it: not counted
    _trace(path, STEP + [("concat_128x64", 20.0, 5.0), ("concat_64x64", 120.0, 3.0), ("nvjet_a", 40.0, 9.0),
                         ("concat_128x64", 410.0, 7.0)])
    kernels = load_kernels(path)
    forward, backward = kernel_starts(path, r"flash_fprop"), kernel_starts(path, r"flash_bprop")
    times = kernel_times(kernels, windows(forward, backward, 2)["step"][0], r"nvjet")
    assert times["concat_#x#"] == 8.0
    assert "nvjet_a" not in times and times["adamw"] == 1.0


def test_the_kernel_rows_put_the_largest_loss_against_a_tpth_of_tp1_first():
    one = {"concat": 80.0, "norm": 40.0, "copy_only_at_tp1": 8.0}
    two = {"concat": 60.0, "norm": 21.0, "barrier": 5.0}
    rows = kernel_table(one, two, 2, top=3).splitlines()
    assert rows[0] == "| kernel | 1/2 of tp=1 | tp=2 | over |"
    assert rows[2:] == ["| `concat` | 40 | 60 | +20 |", "| `barrier` | 0 | 5 | +5 |", "| `norm` | 20 | 21 | +1 |"]
