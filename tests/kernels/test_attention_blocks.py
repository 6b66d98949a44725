"""Attention split by key block (forward with lse, merged; backward from the merged out/lse) equals
attention over all keys, forward and backward: the identity ring attention is built on."""
import pytest
import torch

from tests.kernels.helpers import assert_rel, needs_interpreter
from tpflash.kernels import use_backend
from tpflash.kernels.attention_blocks import attention_block_backward, attention_block_forward
from tpflash.kernels.reference import attention_reference


def _inputs(seq, heads_q, heads_kv, dim, dtype, device):
    torch.manual_seed(0)
    make = lambda h: torch.randn(2, seq, h, dim, device=device, dtype=dtype)  # noqa: E731
    return make(heads_q), make(heads_kv), make(heads_kv), make(heads_q)


def _split_keys_attention(q, k, v, grad_out, causal, scale, split):
    """out, dq, dk, dv from two key blocks [0, split) and [split, seq): the second block is the
    causal diagonal (bottom-right aligned on the queries' tail), the first is seen whole."""
    seq = q.shape[1]
    blocks = [(slice(0, seq), slice(0, split), False), (slice(0, seq), slice(split, seq), causal)]
    if causal:  # queries before `split` see only the first block; the tail's diagonal is causal
        blocks = [(slice(0, split), slice(0, split), True), (slice(split, seq), slice(0, split), False),
                  (slice(split, seq), slice(split, seq), True)]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], seq), float("-inf"), device=q.device)
    for rows, cols, block_causal in blocks:
        o, l = attention_block_forward(q[:, rows], k[:, cols], v[:, cols], block_causal, scale)
        merged = torch.logaddexp(lse[:, :, rows], l)
        out[:, rows] = (out[:, rows] * torch.exp(lse[:, :, rows] - merged).transpose(1, 2)[..., None]
                        + o.float() * torch.exp(l - merged).transpose(1, 2)[..., None])
        lse[:, :, rows] = merged
    out = out.to(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in (q, k, v))
    for rows, cols, block_causal in blocks:
        g_q, g_k, g_v = attention_block_backward(q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows],
                                                 grad_out[:, rows], block_causal, scale)
        dq[:, rows] += g_q
        dk[:, cols] += g_k
        dv[:, cols] += g_v
    return out, dq, dk, dv


def _check(backend, causal, heads_kv, dtype=torch.float32, device="cpu", tol_scale=1.0):
    q, k, v, grad_out = _inputs(24, 4, heads_kv, 16, dtype, device)
    scale = 0.25
    with use_backend(backend):
        out, dq, dk, dv = _split_keys_attention(q, k, v, grad_out, causal, scale, split=10)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, causal=causal, softmax_scale=scale)
    ref.backward(grad_out.double())
    assert_rel(out, ref, dtype, "out", tol_scale)
    for name, got, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        assert_rel(got, leaf.grad, dtype, name, tol_scale)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_key_blocks_merge_to_full_attention_reference_backend(causal, heads_kv):
    _check("reference", causal, heads_kv)


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_merge_to_full_attention_triton(causal):
    _check("triton", causal, heads_kv=2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_merge_to_full_attention_on_gpu(causal):
    _check("triton", causal, heads_kv=2, dtype=torch.bfloat16, device="cuda")
