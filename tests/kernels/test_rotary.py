"""Triton rotary embedding vs a float64 reference, forward and backward, in and out of place."""
import pytest
import torch

from tests.kernels.helpers import DEVICE, assert_rel, float64_twin, needs_interpreter, run_with_grads
from tpflash.kernels import apply_rotary, use_backend
from tpflash.kernels.reference import rotary_reference


def _inputs(shape, rotary_dim, dtype, device="cpu"):
    torch.manual_seed(0)
    seq = shape[-3]
    x = torch.randn(seq, *shape[:-3], *shape[-2:], device=device, dtype=dtype).movedim(0, -3)  # seq-first storage
    angles = torch.rand(seq, rotary_dim // 2, device=device) * 6.3
    return x, angles.cos(), angles.sin()


def _check(shape, rotary_dim, interleaved, dtype=torch.float32, device="cpu"):
    x, cos, sin = _inputs(shape, rotary_dim, dtype, device)
    fn = lambda x, c, s: apply_rotary(x, c, s, interleaved=interleaved)  # noqa: E731
    grad_out = [torch.randn_like(x)]
    outs, grads = run_with_grads(fn, [x, cos, sin], grad_out, grad_of=[0])
    ref_outs, ref_grads = float64_twin(fn, [x, cos, sin], grad_out, grad_of=[0])
    assert_rel(outs[0], ref_outs[0], dtype, "out")
    assert_rel(grads[0], ref_grads[0], dtype, "dx")


@needs_interpreter
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("shape, rotary_dim", [((2, 7, 3, 16), 16), ((2, 7, 3, 20), 12), ((7, 3, 16), 10),
                                               ((2, 37, 1, 16), 16)],
                         ids=["full", "partial", "varlen", "one_head_many_positions_per_program"])
def test_rotary_matches_reference(interleaved, shape, rotary_dim):
    _check(shape, rotary_dim, interleaved)


@needs_interpreter
def test_inplace_rotary_writes_into_x_and_backpropagates():
    x, cos, sin = _inputs((2, 5, 3, 16), 16, torch.float32)
    leaf = x.clone().requires_grad_()
    y = leaf * 1.0
    with use_backend("triton"):
        out = apply_rotary(y, cos, sin, inplace=True)
    assert out is y
    assert_rel(out, rotary_reference(x.double(), cos.double(), sin.double()), torch.float32, "out")
    out.sum().backward()
    ref = x.double().requires_grad_()
    rotary_reference(ref, cos.double(), sin.double()).sum().backward()
    assert_rel(leaf.grad, ref.grad, torch.float32, "dx")


def test_half_split_reference_rotates_pairs_i_and_i_plus_half():
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])  # [1, 1, 1, 4]
    cos, sin = torch.zeros(1, 2), torch.ones(1, 2)  # a quarter turn: (a, b) -> (-b, a)
    assert rotary_reference(x, cos, sin).flatten().tolist() == [-3.0, -4.0, 1.0, 2.0]
    assert rotary_reference(x, cos, sin, interleaved=True).flatten().tolist() == [-2.0, 1.0, -4.0, 3.0]


def test_rotary_rejects_cos_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"cos/sin cover seq=4 positions but x has seq=5"):
        apply_rotary(torch.randn(1, 5, 2, 8), torch.ones(4, 4), torch.ones(4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half_split", "interleaved"])
@pytest.mark.parametrize("shape", [(4, 1024, 16, 128), (4, 2048, 1, 64), (3, 1000, 2, 64)],
                         ids=["heads16", "one_kv_head", "seq_not_a_block_multiple"])
def test_rotary_matches_reference_on_gpu(interleaved, shape):
    _check(shape, shape[-1], interleaved, torch.bfloat16, DEVICE)
