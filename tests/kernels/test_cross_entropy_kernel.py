"""Triton cross-entropy row kernels (statistics and gradient) vs their references."""
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DEVICE, assert_rel, needs_interpreter
from tpflash.kernels import use_backend
from tpflash.kernels.cross_entropy import cross_entropy_grad, cross_entropy_stats
from tpflash.kernels.cross_entropy_kernel import INTERPRET_STATS
from tpflash.losses import vocab_parallel_cross_entropy


def _inputs(rows, cols, dtype, device="cpu"):
    torch.manual_seed(0)
    logits = (torch.randn(rows, cols, device=device) * 4).to(dtype)
    target_col = torch.randint(0, cols, (rows,), device=device, dtype=torch.int32)
    target_col[::3] = -1  # targets held by another rank
    return logits, target_col


def _both(fn):
    with use_backend("triton"):
        got = fn()
    with use_backend("reference"):
        want = fn()
    return got, want


def _check_stats(rows, cols, real_cols, dtype, device="cpu"):
    logits, target_col = _inputs(rows, cols, dtype, device)
    target_col = target_col.clamp_max(real_cols - 1)
    got, want = _both(lambda: cross_entropy_stats(logits, target_col, real_cols, with_sum=True))
    for name, g, w in zip(["max", "sum_exp", "target_logit", "sum"], got, want):
        assert_rel(g, w, torch.float32, name, scale=10.0)


def _check_grad(rows, cols, real_cols, dtype, device="cpu"):
    logits, target_col = _inputs(rows, cols, dtype, device)
    target_col = target_col.clamp_max(real_cols - 1)
    lse = torch.logsumexp(logits[:, :real_cols].float(), dim=-1)
    scale = torch.rand(rows, device=device)
    got, want = _both(lambda: cross_entropy_grad(logits, lse, target_col, scale, real_cols, 0.1, real_cols * 2, 1e-3))
    assert got.dtype == logits.dtype
    assert_rel(got, want, dtype, "grad")


@needs_interpreter
def test_stats_kernel_matches_reference():
    _check_stats(5, 300, 260, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("real_cols", [1, 63, 64, 130, 256, 300], ids=lambda c: f"real{c}")
def test_stats_kernel_handles_every_chunk_boundary(real_cols):
    # CHUNK 128 = 2 tiles of 64 here: 130 real columns leave chunk 1 one partial tile and one
    # tile of padding only (m = -inf, s = 0 there), 256 ends exactly on a chunk, 300 is the whole row
    assert (INTERPRET_STATS["CHUNK"], INTERPRET_STATS["BLOCK"]) == (128, 64)
    _check_stats(7, 300, real_cols, torch.float32)


@needs_interpreter
def test_stats_kernel_picks_targets_in_every_chunk():
    logits, _ = _inputs(6, 300, torch.float32)
    target_col = torch.tensor([0, 127, 128, 255, 299, -1], dtype=torch.int32)  # chunks 0, 0, 1, 1, 2, none
    got, want = _both(lambda: cross_entropy_stats(logits, target_col, 300))
    assert torch.equal(got[2], want[2])
    assert torch.equal(got[3], torch.zeros(6))  # no sum unless with_sum


@needs_interpreter
def test_stats_kernel_with_tiles_and_chunks_of_minus_inf_logits():
    # masked-out vocabulary: a tile (row 0) or a whole chunk (row 1) of -inf must add 0, not NaN
    logits, target_col = _inputs(3, 300, torch.float32)
    logits[0, :64] = float("-inf")
    logits[1, 128:256] = float("-inf")
    target_col = torch.tensor([100, 5, -1], dtype=torch.int32)
    got, want = _both(lambda: cross_entropy_stats(logits, target_col, 300))
    for name, g, w in zip(["max", "sum_exp", "target_logit"], got, want):
        assert_rel(g, w, torch.float32, name, scale=10.0)


@needs_interpreter
def test_stats_kernel_on_a_shard_of_padding_only():
    logits, target_col = _inputs(5, 300, torch.float32)
    with use_backend("triton"):
        row_max, sum_exp, picked, total = cross_entropy_stats(logits, target_col.clamp_max(-1), 0, with_sum=True)
    assert torch.equal(row_max, torch.full((5,), float("-inf")))
    assert torch.equal(sum_exp, torch.zeros(5)) and torch.equal(picked, torch.zeros(5))
    assert torch.equal(total, torch.zeros(5))


@needs_interpreter
def test_stats_kernel_reads_rows_of_a_wider_buffer():
    wide, target_col = _inputs(5, 400, torch.float32)
    logits = wide[:, :300]  # row stride 400
    target_col = target_col.clamp_max(259)
    got, want = _both(lambda: cross_entropy_stats(logits, target_col, 260, with_sum=True))
    for name, g, w in zip(["max", "sum_exp", "target_logit", "sum"], got, want):
        assert_rel(g, w, torch.float32, name, scale=10.0)


@needs_interpreter
def test_grad_kernel_matches_reference_and_zeroes_padding():
    _check_grad(5, 300, 260, torch.float32)


@needs_interpreter
def test_grad_kernel_can_write_into_the_logits():
    logits, target_col = _inputs(4, 70, torch.float32)
    lse = torch.logsumexp(logits, dim=-1)
    want = cross_entropy_grad(logits, lse, target_col, torch.ones(4), 70)
    with use_backend("triton"):
        got = cross_entropy_grad(logits, lse, target_col, torch.ones(4), 70, out=logits)
    assert got is logits
    assert_rel(got, want, torch.float32, "in-place grad")


@needs_interpreter
def test_inplace_backward_loss_gives_the_torch_gradient():
    logits, _ = _inputs(6, 50, torch.float32)
    target = torch.randint(0, 50, (6,))
    mine = (logits * 1.0).requires_grad_()
    ref = logits.clone().requires_grad_()
    with use_backend("triton"):
        vocab_parallel_cross_entropy(mine * 1.0, target, inplace_backward=True).backward()
    F.cross_entropy(ref, target).backward()
    assert_rel(mine.grad, ref.grad, torch.float32, "grad")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_kernels_match_reference_on_gpu(dtype):
    _check_stats(512, 64128, 64100, dtype, DEVICE)
    _check_grad(512, 64128, 64100, dtype, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("real_cols", [1, 2048, 4097, 16383, 20000], ids=lambda c: f"real{c}")
def test_stats_kernel_handles_every_chunk_boundary_on_gpu(real_cols):
    # chunk edges of every autotune candidate (2048-16384 columns), and a last chunk of one column
    _check_stats(64, 20000, real_cols, torch.bfloat16, DEVICE)
