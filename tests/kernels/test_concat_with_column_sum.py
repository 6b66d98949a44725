"""concat_with_column_sum: the stacked layers' gradient concatenation with its bias gradient (column
sums) in one pass, against torch.cat and float64 sums: 1-3 parts, 2-D and strided 3-D views (the
attention's [s, b, c] gradients over [b, s, c] memory), bits that repeat, clear errors."""

import pytest
import torch

from tests.kernels.helpers import assert_rel, compiled_for_h100, h100_program, needs_interpreter
from tpflash.kernels import concat_with_column_sum, use_backend
from tpflash.kernels.column_sum import joined_column_blocks


def _parts(lead, widths, dtype, device="cpu", seq_batch_swapped=False):
    torch.manual_seed(0)
    if seq_batch_swapped:  # [s, b, c] views of [b, s, c] memory
        s, b = lead
        return [torch.randn(b, s, w, device=device).to(dtype).transpose(0, 1) for w in widths]
    return [torch.randn(*lead, w, device=device).to(dtype) for w in widths]


def _check(parts):
    with use_backend("triton"):
        out, sums = concat_with_column_sum(parts)
    expected = torch.cat(parts, dim=-1).reshape(-1, out.shape[-1])
    assert out.is_contiguous() and out.dtype == parts[0].dtype and torch.equal(out, expected)
    assert sums.dtype == torch.float32
    assert_rel(sums, expected.double().sum(0), torch.float32, f"{len(parts)} parts")


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("widths", [(40,), (40, 24), (64, 33, 33)])
def test_concat_of_matrices_equals_torch_cat_and_sums(widths, dtype):
    _check(_parts((37,), widths, dtype))


@needs_interpreter
@pytest.mark.parametrize("widths", [(32, 16, 16), (48, 48)])
def test_concat_reads_seq_first_views_of_batch_first_memory(widths):
    _check(_parts((12, 3), widths, torch.bfloat16, seq_batch_swapped=True))


@needs_interpreter
def test_concat_reads_column_slices_of_a_wider_matrix():
    wide = torch.randn(50, 100)
    _check([wide[:, :30], wide[:, 40:72]])


@needs_interpreter
def test_concat_repeats_its_bits():
    parts = _parts((300,), (64, 32, 32), torch.bfloat16)
    with use_backend("triton"):
        first, again = concat_with_column_sum(parts), concat_with_column_sum([p.clone() for p in parts])
    assert torch.equal(first[1], again[1])


def test_concat_rejects_parts_that_do_not_line_up():
    with pytest.raises(ValueError, match="leading sizes"):
        concat_with_column_sum([torch.zeros(4, 3), torch.zeros(5, 3)])
    with pytest.raises(ValueError, match="1 to 3 parts"):
        concat_with_column_sum([torch.zeros(4, 3)] * 4)


def test_the_reference_backend_is_torch_cat_and_sum():
    parts = _parts((4, 3), (5, 6), torch.float32)
    with use_backend("reference"):
        out, sums = concat_with_column_sum(parts)
    assert torch.equal(out, torch.cat(parts, -1).reshape(12, 11))
    torch.testing.assert_close(sums, out.sum(0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("widths", [(2048, 2048, 2048), (1280, 1280, 1280), (5120, 5120)])
def test_concat_matches_torch_on_gpu(widths):
    parts = _parts((2048, 4), widths, torch.bfloat16, device="cuda", seq_batch_swapped=True)
    _check(parts)
    with use_backend("triton"):
        assert torch.equal(concat_with_column_sum(parts)[1], concat_with_column_sum(parts)[1])


_COMPILE_FOR_H100 = h100_program("concat_with_column_sum", """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpflash.kernels.bias_activation_kernel import LAUNCH
from tpflash.kernels.concat_sum_kernel import _concat_sum_kernel
ints = ["rows", "inner", "cols_a", "cols_b", "cols_c", "so_a", "si_a", "so_b", "si_b", "so_c", "si_c", "total_cols",
        "rows_per_split"]
signature = dict({"A": "*bf16", "B": "*bf16", "C": "*bf16", "OUT": "*bf16", "PARTIALS": "*fp32"},
                 **{k: "i32" for k in ints}, BLOCK_R="constexpr", BLOCK_C="constexpr", STAGES="constexpr")
cfg = LAUNCH[True]
constexprs = {"BLOCK_R": cfg["BLOCK_R"], "BLOCK_C": cfg["BLOCK_C"], "STAGES": cfg["STAGES"]}
compiled = triton.compile(ASTSource(_concat_sum_kernel, signature, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32))
assert compiled.asm["cubin"]
print("compiled")
""")


def test_concat_kernel_compiles_for_an_h100():
    # as test_bias_activation's twin: Triton's compiler rejects what the interpreter lets through
    assert "compiled" in compiled_for_h100(_COMPILE_FOR_H100)


def test_joined_column_blocks_is_the_buffer_the_splits_of_a_contiguous_tensor_view():
    y = torch.randn(4, 3, 10)
    joined = joined_column_blocks(list(y.split([3, 5, 2], dim=-1)))
    assert joined is not None and joined.data_ptr() == y.data_ptr() and torch.equal(joined, y)
    assert torch.equal(joined_column_blocks([y]), y)
    rows = torch.randn(2, 20)[1]  # one row, at a storage offset
    assert torch.equal(joined_column_blocks(list(rows.view(1, 20).split([4, 16], dim=-1))), rows.view(1, 20))


def test_joined_column_blocks_refuses_anything_else():
    y = torch.randn(4, 10)
    a, b, c = y.split([3, 5, 2], dim=-1)
    assert joined_column_blocks([a, c]) is None  # a gap
    assert joined_column_blocks([b, a]) is None  # out of order
    assert joined_column_blocks(list(torch.randn(4, 12)[:, :10].split(5, dim=-1))) is None  # row stride 12
    assert joined_column_blocks([torch.randn(1, 5), torch.randn(1, 5)]) is None  # separate storages
    assert joined_column_blocks(list(torch.randn(10, 4).t().split(5, dim=-1))) is None  # transposed
    assert joined_column_blocks([]) is None
    assert joined_column_blocks(list(torch.randn(0, 10).split(5, dim=-1))) is None


def test_concat_with_column_sum_of_one_buffers_blocks_returns_that_buffer():
    y = torch.randn(6, 5, 12)
    rows, sums = concat_with_column_sum(list(y.split([4, 8], dim=-1)))
    assert rows.data_ptr() == y.data_ptr() and torch.equal(rows, y.view(-1, 12))
    assert torch.allclose(sums, y.view(-1, 12).sum(0), atol=1e-5)


def test_concat_rows_is_the_buffer_for_its_blocks_and_a_concatenation_otherwise():
    from tpflash.kernels.column_sum import concat_rows
    y = torch.randn(6, 5, 12)
    rows = concat_rows(list(y.split([4, 8], dim=-1)))
    assert rows.data_ptr() == y.data_ptr() and torch.equal(rows, y.view(-1, 12))
    a, b = torch.randn(6, 5, 4), torch.randn(6, 5, 8).transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(concat_rows([a, b]), torch.cat([a, b], dim=-1).view(-1, 12))
