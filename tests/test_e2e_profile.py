"""The interval arithmetic behind bench_e2e's exposed-communication figure."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from e2e_profile import comm_and_exposed, minus, union  # noqa: E402


def test_union_merges_overlapping_and_touching_intervals():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]


def test_minus_keeps_the_uncovered_parts():
    assert minus([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]
    assert minus([(0, 1), (4, 5)], [(0, 5)]) == []


def test_exposed_communication_is_nccl_time_with_no_compute_running():
    kernels = [("ncclDevKernel_AllGather", 0, 10), ("gemm", 2, 6), ("ncclDevKernel_ReduceScatter", 12, 14),
               ("layer_norm", 13, 20)]
    comm, exposed = comm_and_exposed(kernels)
    assert comm == 12 and exposed == 6 + 1  # [0,2) + [6,10) + [12,13)
