"""tpflash.kernels.weight_grad_fp32: grad_y^T x in fp32, summed block by block into one gradient."""
import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_rel
from tpflash.kernels import weight_grad
from tpflash.kernels.weight_grad import weight_grad_fp32


def _weight_grad_summed_over_row_blocks(device):
    """weight_grad_fp32(..., into=acc) adds block after block: the sum over row blocks equals the
    weight gradient of all rows at once, to fp32 rounding (the fp32-output GEMM on GPU, an fp32 GEMM
    on CPU): no block is rounded to bf16 on the way."""
    torch.manual_seed(0)
    g = torch.randn(64, 24, device=device).to(torch.bfloat16)
    x = torch.randn(64, 32, device=device).to(torch.bfloat16)
    whole = weight_grad_fp32(g, x)
    acc = None
    for rows in (slice(0, 16), slice(16, 48), slice(48, 64)):
        acc = weight_grad_fp32(g[rows], x[rows], into=acc)
    assert acc.dtype == torch.float32 and acc.shape == (24, 32)
    assert_rel(acc, whole, torch.float32, "weight grad summed over row blocks", scale=10)
    fp32 = weight_grad_fp32(g[:16].float(), x[:16].float(), into=torch.zeros(24, 32, device=device))
    assert_rel(fp32, g[:16].float().t() @ x[:16].float(), torch.float32, "fp32 inputs")


def test_weight_grad_sums_over_row_blocks():
    _weight_grad_summed_over_row_blocks("cpu")


@pytest.mark.gpu
def test_weight_grad_sums_over_row_blocks_with_the_fp32_output_gemm_on_gpu():
    _weight_grad_summed_over_row_blocks(DEVICE)
    assert weight_grad._ADDMM_OUT_DTYPE[0] is True, "torch.addmm(out_dtype=float32, out=) was not used"
