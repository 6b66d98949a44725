"""benchmarks/idle_gaps.py: the gaps between a step's compute kernels, grouped by what surrounds them."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from idle_gaps import gpu_events, idle_gaps, one_step, report, short  # noqa: E402


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


# one block per step: forward attention, a GEMM that waits 10 us at a barrier for its peer's part,
# a memset 3 us after the GEMM and a GEMM 2 us after it (a copy-engine push running beside them),
# the backward attention, then the next step's forward attention
STEP = [_kernel("cudnn_flash_fprop", 0, 10), _kernel("nvjet_gemm_a", 10, 20),
        _kernel("c10d::symmetric_memory::barrier_kernel(x)", 30, 12), _kernel("void add_kernel<8>(y)", 40, 5),
        _kernel("Memset (Device)", 48, 1, cat="gpu_memset"), _kernel("Memcpy PtoP (Device -> Device)", 45, 20, cat="gpu_memcpy"),
        _kernel("nvjet_gemm_b", 51, 9), _kernel("cudnn_flash_bprop", 60, 40)]


def _shifted(events, by):
    return [dict(e, ts=e["ts"] + by) for e in events]


def test_gaps_are_grouped_by_the_kernels_around_them_and_what_ran_in_them():
    span, idle, groups = idle_gaps(STEP)
    assert span == 100 and idle == 10 + 3 + 2
    assert groups == {("GEMM", "barrier", "add_kernel"): (10, 1), ("add_kernel", "peer copy", "memset"): (3, 1),
                      ("memset", "peer copy", "GEMM"): (2, 1)}


def test_copies_barriers_and_nccl_are_waits_not_compute():
    waiting = [_kernel("cudnn_flash_fprop", 0, 10), _kernel("ncclDevKernel_AllGather_RING_LL(x)", 10, 50),
               _kernel("nvjet_gemm", 60, 10)]
    assert idle_gaps(waiting)[1:] == (50, {("attention forward", "NCCL", "GEMM"): (50, 1)})


def test_the_second_of_two_steps_is_the_one_measured(tmp_path):
    path = str(tmp_path / "t.json.gz")
    second = _shifted(STEP, 1000)
    second[1]["dur"] = 10  # the second step's GEMM ends 10 us earlier: 10 us more idle before the add
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": STEP + second + [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 1}]}, f)
    step = one_step(gpu_events(path))
    assert step[0]["ts"] == 1000 and len(step) == len(STEP)
    assert idle_gaps(step)[1] == 25


def test_a_trace_without_a_training_step_says_so():
    with pytest.raises(ValueError, match="no forward attention kernel"):
        one_step([_kernel("nvjet_gemm", 0, 10)])


def test_names_are_shortened_to_their_family_or_bare_name():
    assert short("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "GEMM"
    assert short("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>(int)") == \
        "vectorized_elementwise_kernel"
    assert "| 10 | 1 | GEMM | barrier | add_kernel |" in report(*idle_gaps(STEP), top=5)
