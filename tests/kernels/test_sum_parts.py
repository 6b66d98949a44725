"""sum_parts: tensors added in fp32 in order and rounded once; the Triton kernel gives torch's bits."""
import pytest
import torch

from tests.kernels.helpers import needs_interpreter
from tpflash.kernels import sum_parts, use_backend


def _parts(count, numel, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(count * 1000 + numel)
    return [torch.randn(numel, generator=g).mul(10 ** i).to(dtype).to(device) for i in range(count)]


def _written_out(parts, dtype):
    total = parts[0].float().clone()
    for p in parts[1:]:
        total += p
    return total.to(dtype)


def _triton_sum(parts, dtype):
    with use_backend("triton"):
        return sum_parts(parts, dtype)


@needs_interpreter
@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("numel", [1, 100, 257])
def test_the_triton_sum_gives_the_bits_of_the_torch_sum(count, numel):
    parts = _parts(count, numel)
    assert torch.equal(_triton_sum(parts, torch.float32), _written_out(parts, torch.float32))
    # Triton's interpreter rounds fp32 to bf16 toward zero, the GPU to nearest (the GPU twin checks its bits)
    out, exact = _triton_sum(parts, torch.bfloat16), _written_out(parts, torch.float32)
    assert out.dtype == torch.bfloat16 and out.shape == parts[0].shape
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((out.float() - exact).abs() <= ulp).all()


@pytest.mark.gpu
@pytest.mark.parametrize("count", [3, 4])
def test_the_triton_sum_gives_the_bits_of_the_torch_sum_on_gpu(count):
    parts = _parts(count, 5 * 4096 + 3, device="cuda")
    assert torch.equal(_triton_sum(parts, torch.bfloat16), _written_out(parts, torch.bfloat16))


@needs_interpreter
def test_the_triton_sum_reads_parts_of_other_dtypes_and_shapes():
    parts = [p.view(3, 5, 7) for p in _parts(3, 105)]
    parts[1] = parts[1].float()
    out = _triton_sum(parts, torch.float32)
    assert out.shape == (3, 5, 7) and torch.equal(out, _written_out(parts, torch.float32))


def test_the_reference_adds_in_fp32_and_rounds_once():
    parts = [torch.tensor([256.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16),
             torch.tensor([1.0], dtype=torch.bfloat16)]
    # bf16 step at 256 is 2: adding 1 twice in bf16 would stay at 256; in fp32 it reaches 258
    assert sum_parts(parts, torch.bfloat16).item() == 258.0


def test_an_fp32_first_part_is_not_added_into():
    parts = [torch.ones(4), torch.ones(4), torch.ones(4)]
    assert torch.equal(sum_parts(parts, torch.float32), torch.full((4,), 3.0))
    assert torch.equal(parts[0], torch.ones(4))


def test_more_parts_than_the_kernel_takes_are_added_by_torch():
    parts = _parts(6, 50)
    with use_backend("reference"):
        assert torch.equal(sum_parts(parts, torch.bfloat16), _written_out(parts, torch.bfloat16))


@pytest.mark.parametrize("parts, rule", [
    ([torch.ones(3)], "at least 2"),
    ([torch.ones(3), torch.ones(4)], "shape (3,)"),
    ([torch.ones(3), torch.ones(3, dtype=torch.int64)], "float tensor"),
])
def test_bad_parts_are_one_clear_error(parts, rule):
    with pytest.raises(ValueError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        sum_parts(parts, torch.float32)
