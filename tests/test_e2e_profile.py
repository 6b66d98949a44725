"""The interval arithmetic behind bench_e2e's exposed-communication figure."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from e2e_profile import alone_by_category, category, comm_and_exposed, kernel_breakdown, minus, union  # noqa: E402


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


def test_kernel_breakdown_sums_time_per_category_per_step():
    kernels = [("ncclDevKernel_AllGather", 0, 4), ("sm90_xmma_gemm_bf16", 4, 10), ("_layer_norm_fwd", 10, 11),
               ("sm90_xmma_gemm_bf16", 11, 17), ("vectorized_elementwise_kernel", 17, 18)]
    out = kernel_breakdown(kernels, steps=2)
    assert out["by_category"] == {"gemm": 6.0, "comm": 2.0, "norm": 0.5, "other": 0.5}
    assert out["top_kernels"][0] == ("sm90_xmma_gemm_bf16", 6.0)
    assert category("cudnn_generated_fort_native_sdpa_sm90") == "attention"


def test_copies_barriers_and_weight_casts_have_their_own_categories():
    assert category("Memcpy PtoP (Device -> Device)") == "copy engine"
    assert category("void c10d::symmetric_memory::barrier_kernel(...)") == "barrier"
    assert category("multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor<c10::BFloat16, float>>") == "weight cast"
    assert category("multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>") == "optimizer"
    assert category("Memset (Device)") == "copy/memset"


def test_alone_by_category_splits_the_span_into_solo_overlapped_and_idle_time():
    kernels = [("nvjet_gemm", 0, 10), ("Memcpy PtoP (Device -> Device)", 6, 14), ("barrier_kernel", 14, 15),
               ("nvjet_gemm", 17, 21)]
    out = alone_by_category(kernels, steps=2)
    # gemm alone [0,6) + [17,21); copy alone [10,14); overlapped [6,10); barrier [14,15); idle [15,17)
    assert out == {"gemm": 5.0, "copy engine": 2.0, "overlapped": 2.0, "barrier": 0.5, "idle": 1.0}


def test_trace_lag_finds_idle_gaps_and_the_launching_op():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from trace_lag import summarise
    events = [  # two kernels; the second launched late by "aten::mm", leaving the GPU idle 90 us
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 5, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 10, "dur": 10, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 100, "dur": 20},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 105, "dur": 5, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 110, "dur": 10, "args": {"correlation": 2}},
    ]
    s = summarise(events, steps=1)
    assert s["kernels_per_step"] == 2
    assert abs(s["gpu_idle_ms"] - 0.090) < 1e-9
    assert s["idle_by_host_op_ms"] == [("aten::mm", 0.090, 1)]
    assert s["short_lag_fraction"] == 1.0


def test_telemetry_parses_nvidia_smi_samples_and_skips_other_lines():
    from e2e_telemetry import parse_samples
    lines = ["1665, 688.12, Active", "1980, 95.40, Not Active", "", "[N/A], 90.0, Not Active", "garbage"]
    assert parse_samples(lines) == [(1665.0, 688.12, True), (1980.0, 95.4, False)]


def test_telemetry_without_nvidia_smi_gives_an_empty_summary(monkeypatch):
    import e2e_telemetry
    monkeypatch.setattr(e2e_telemetry.shutil, "which", lambda name: None)
    with e2e_telemetry.GpuTelemetry(0) as tel:
        pass
    assert tel.summary() == {}


def test_each_configuration_of_a_launch_writes_its_own_trace(tmp_path):
    from types import SimpleNamespace

    from e2e_timing import _trace_path
    ps = SimpleNamespace(tp_size=4, rank=0)
    paths = {_trace_path(SimpleNamespace(trace_dir=str(tmp_path), trace_label=f"{model}_tpflash-graphs"), ps)
             for model in ("gpt-2.7b", "llama-1b")}
    assert paths == {str(tmp_path / "trace_gpt-2.7b_tpflash-graphs_tp4_rank0.json"),
                     str(tmp_path / "trace_llama-1b_tpflash-graphs_tp4_rank0.json")}
    assert _trace_path(SimpleNamespace(trace_dir="", trace_label="x"), ps) == ""
