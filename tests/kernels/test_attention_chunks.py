"""Causal attention by query chunks (tpflash.kernels.attention_chunks) against the whole attention, and
its backward from the output and log-sum-exp against autograd: the reference and the Triton kernels
(the interpreter on CPU), cuDNN's backward on the GPU."""
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import assert_rel, float64_twin, needs_interpreter
from tpflash.kernels import use_backend
from tpflash.kernels.attention_chunks import ChunkedCausalAttention, causal_attention_backward, chunked_attention_backend
from tpflash.kernels.reference import attention_backward_reference, attention_reference


def _column_slices(seq, batch, heads, heads_kv, dim, dtype=torch.float32, device="cpu"):
    """q [s, b, heads, d], k/v [s, b, heads_kv, d]: column slices of one [s, b, (heads + 2*heads_kv)*d]
    tensor, as the q/k/v projection leaves them."""
    torch.manual_seed(0)
    qkv = torch.randn(seq, batch, (heads + 2 * heads_kv) * dim, dtype=dtype, device=device)
    q, k, v = qkv.split([heads * dim, heads_kv * dim, heads_kv * dim], dim=-1)
    return q.view(seq, batch, heads, dim), k.view(seq, batch, heads_kv, dim), v.view(seq, batch, heads_kv, dim)


def _whole(q, k, v, scale):
    """(out [s, b, h, d], lse [b, h, s]) of the reference's causal attention over seq-first inputs, in fp64."""
    out, lse = attention_reference(*(t.double().transpose(0, 1) for t in (q, k, v)), True, scale, return_lse=True)
    return out.transpose(0, 1), lse


def _by_chunks(q, k, v, chunks, scale, backend, order):
    attn = ChunkedCausalAttention(q, k, v, chunks, scale, backend)
    size = q.shape[0] // chunks
    for r in order:  # a rank computes its peers' rows first, in its own order
        rows = attn.rows(r)
        assert rows.data_ptr() == attn.out[r * size].data_ptr(), "a chunk's rows are a view of the whole output"
    return attn


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("heads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_the_reference_by_chunks_equals_the_whole_attention_in_any_order_of_chunks(chunks, heads_kv):
    q, k, v = _column_slices(12, 2, 4, heads_kv, 8)
    attn = _by_chunks(q, k, v, chunks, 0.3, "reference", reversed(range(chunks)))
    out, lse = _whole(q, k, v, 0.3)
    assert_rel(attn.out, out, torch.float32, "out")
    assert_rel(attn.lse, lse, torch.float32, "lse")


@needs_interpreter
@pytest.mark.parametrize("chunks, heads_kv", [(2, 3), (4, 1)], ids=["mha_2", "mqa_4"])
def test_triton_by_chunks_equals_the_whole_attention(chunks, heads_kv):
    q, k, v = _column_slices(48, 2, 3, heads_kv, 20)  # chunks past one 16-row block; head_dim short of a power of 2
    with use_backend("triton"):
        attn = _by_chunks(q, k, v, chunks, 0.3, "triton", [1, 0] + list(range(2, chunks)))
    out, lse = _whole(q, k, v, 0.3)
    assert_rel(attn.out, out, torch.float32, "out")
    assert_rel(attn.lse, lse, torch.float32, "lse")


def test_chunked_attention_rejects_a_sequence_that_does_not_split_into_the_chunks():
    q = torch.randn(10, 1, 2, 8)
    with pytest.raises(ValueError, match="sequence length 10 is not divisible into 4 query chunks"):
        ChunkedCausalAttention(q, q, q, 4, 0.3, "reference")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_kv", [4, 1], ids=["mha", "mqa"])
def test_attention_backward_from_out_and_lse_equals_autograd(causal, heads_kv):
    torch.manual_seed(0)
    q = torch.randn(2, 6, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, heads_kv, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, heads_kv, 8, dtype=torch.float64, requires_grad=True)
    out, lse = attention_reference(q, k, v, causal, 0.3, return_lse=True)
    grad_out = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), grad_out)
    got = attention_backward_reference(q, k, v, out.detach(), grad_out, lse, causal, 0.3)
    for name, g, w in zip("qkv", got, want):
        assert_rel(g, w, torch.float32, f"d{name}")  # lse comes back in fp32


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_the_backward_over_the_assembled_output_equals_autograd_of_the_whole_attention(backend):
    q, k, v = _column_slices(32, 2, 2, 1, 16)
    with use_backend(backend):
        attn = _by_chunks(q, k, v, 2, 0.3, backend, [0, 1])
        grad_out = torch.randn_like(attn.out)
        got = causal_attention_backward(q, k, v, attn.out, attn.lse, grad_out, 0.3, backend)
    fn = lambda q, k, v: attention_reference(q, k, v, True, 0.3)  # noqa: E731
    _, want = float64_twin(fn, [t.transpose(0, 1) for t in (q, k, v)], [grad_out.transpose(0, 1)])
    for name, g, w, t in zip("qkv", got, want, (q, k, v)):
        assert g.shape == t.shape, f"d{name}: shape {tuple(g.shape)}"
        assert_rel(g, w.transpose(0, 1), torch.float32, f"d{name}")


def test_the_backend_is_the_reference_on_cpu():
    assert chunked_attention_backend(torch.randn(8, 1, 2, 16)) == "reference"


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("heads, heads_kv, head_dim", [(8, 8, 80), (8, 2, 64), (4, 1, 128)],
                         ids=["gpt_mha", "llama_gqa", "mqa_128"])
def test_triton_chunks_and_the_cudnn_backward_match_sdpa_on_gpu(chunks, heads, heads_kv, head_dim):
    seq, batch, scale = 1024, 2, head_dim ** -0.5
    q, k, v = (t.detach().requires_grad_() for t in _column_slices(seq, batch, heads, heads_kv, head_dim,
                                                                      torch.bfloat16, "cuda"))
    assert chunked_attention_backend(q) == "triton"
    gqa = {"enable_gqa": True} if heads != heads_kv else {}
    want = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True, scale=scale,
                                          **gqa).permute(2, 0, 1, 3)  # [s, b, h, d]
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    attn = _by_chunks(q.detach(), k.detach(), v.detach(), chunks, scale, "triton", reversed(range(chunks)))
    assert_rel(attn.out, want, torch.bfloat16, "out")
    got = causal_attention_backward(q.detach(), k.detach(), v.detach(), attn.out, attn.lse, grad_out, scale, "triton")
    for name, g, w in zip("qkv", got, want_grads):
        assert_rel(g, w, torch.bfloat16, f"d{name}")
