"""column_sum: the Triton fp32 column sum vs torch's, on odd shapes, empty inputs and repeated calls."""
import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_rel, needs_interpreter
from tpflash.kernels import column_sum, use_backend


def _triton_sum(x):
    with use_backend("triton"):
        return column_sum(x)


def _check(rows, cols, dtype, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=device).to(dtype)
    out = _triton_sum(x)
    assert out.dtype == torch.float32 and out.shape == (cols,)
    assert_rel(out, x.double().sum(0), torch.float32, f"[{rows}, {cols}] {dtype}")


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 37, 300])
@pytest.mark.parametrize("cols", [1, 5, 130])
def test_column_sum_matches_torch(rows, cols, dtype):
    _check(rows, cols, dtype)


@needs_interpreter
def test_column_sum_of_no_rows_is_zeros():
    out = _triton_sum(torch.empty(0, 130, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(130))


@needs_interpreter
def test_column_sum_reads_rows_of_a_wider_matrix():
    # a column slice: row stride 40, not cols (the fused q/k/v gradients are split this way)
    x = torch.randn(70, 40)[:, 3:33]
    assert_rel(_triton_sum(x), x.double().sum(0), torch.float32, "column slice")


@needs_interpreter
def test_column_sum_of_a_transposed_matrix_matches_torch():
    x = torch.randn(12, 37).t()  # last-dim stride 37: summed by torch
    assert_rel(_triton_sum(x), x.double().sum(0), torch.float32, "transposed")


@needs_interpreter
def test_column_sum_repeats_its_bits():
    torch.manual_seed(1)
    x = torch.randn(300, 130).to(torch.bfloat16)
    assert torch.equal(_triton_sum(x), _triton_sum(x))


def test_column_sum_rejects_a_vector():
    with pytest.raises(ValueError, match=r"2-D \[rows, cols\] tensor, got shape \(5,\)"):
        column_sum(torch.zeros(5))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, cols", [(8192, 2048), (8192, 8192), (8191, 2050)])
def test_column_sum_matches_torch_on_gpu(rows, cols):
    _check(rows, cols, torch.bfloat16, DEVICE)


@pytest.mark.gpu
def test_column_sum_repeats_its_bits_on_gpu():
    # tp ranks that sum the same replicated gradient must get the same bits
    x = torch.randn(8192, 2048, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(_triton_sum(x), _triton_sum(x))


def _partials_check(splits, cols, device="cpu"):
    from tpflash.kernels.column_sum_kernel import sum_partials
    torch.manual_seed(1)
    partials = torch.randn(splits, cols, device=device)
    out = sum_partials(partials)
    assert out.dtype == torch.float32 and out.shape == (cols,)
    assert_rel(out, partials.double().sum(0), torch.float32, f"partials [{splits}, {cols}]")
    assert torch.equal(out, sum_partials(partials)), "the partials' sum changed bits between calls"


@needs_interpreter
@pytest.mark.parametrize("splits,cols", [(1, 5), (7, 130), (300, 33)])
def test_the_partial_sums_are_added_up_in_one_launch(splits, cols):
    _partials_check(splits, cols)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,cols", [(7, 2560), (132, 5120), (528, 1920)])
def test_the_partial_sums_are_added_up_in_one_launch_on_gpu(splits, cols):
    _partials_check(splits, cols, device="cuda")
