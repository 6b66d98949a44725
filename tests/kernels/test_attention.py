"""Triton flash attention vs a float64 reference, forward and backward."""
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DEVICE, assert_rel, float64_twin, needs_interpreter, run_with_grads
from tpflash.kernels import flash_attention, use_backend
from tpflash.kernels.reference import attention_reference


def _qkv(batch, seq_q, seq_k, heads_q, heads_kv, dim, dtype, device="cpu", seq_first=False):
    torch.manual_seed(0)
    if seq_first:  # the layout callers pass: transposed views of [seq, batch, heads, dim] tensors
        make = lambda s, h: torch.randn(s, batch, h, dim, device=device, dtype=dtype).transpose(0, 1)  # noqa: E731
    else:
        make = lambda s, h: torch.randn(batch, s, h, dim, device=device, dtype=dtype)  # noqa: E731
    return make(seq_q, heads_q), make(seq_k, heads_kv), make(seq_k, heads_kv)


def _check(q, k, v, dtype, scale=1.0, **kwargs):
    """Triton out, lse, dq, dk, dv against the float64 reference."""
    fn = lambda q, k, v: flash_attention(q, k, v, **kwargs)  # noqa: E731
    torch.manual_seed(1)
    grad_out = [torch.randn_like(q)]
    outs, grads = run_with_grads(fn, [q, k, v], grad_out)
    ref_outs, ref_grads = float64_twin(fn, [q, k, v], grad_out)
    assert_rel(outs[0], ref_outs[0], dtype, "out", scale)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_rel(g, r, dtype, f"d{name}", scale)
    with use_backend("triton"):
        _, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
    with use_backend("reference"):
        _, ref_lse = flash_attention(q.double(), k.double(), v.double(), return_lse=True, **kwargs)
    seen = torch.isfinite(ref_lse)
    assert_rel(lse[seen], ref_lse[seen], dtype, "lse")


@needs_interpreter
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_reference(causal):
    _check(*_qkv(2, 33, 33, 2, 2, 16, torch.float32), torch.float32, causal=causal)


@needs_interpreter
@pytest.mark.parametrize("heads_kv", [1, 2])
def test_attention_gqa_and_mqa_match_reference(heads_kv):
    _check(*_qkv(1, 24, 24, 4, heads_kv, 16, torch.float32), torch.float32, causal=True)


@needs_interpreter
@pytest.mark.parametrize("seq_q, seq_k", [(20, 37), (37, 20)])
def test_causal_attention_with_unequal_lengths_is_bottom_right_aligned(seq_q, seq_k):
    _check(*_qkv(1, seq_q, seq_k, 2, 1, 16, torch.float32), torch.float32, causal=True)


@needs_interpreter
def test_attention_odd_head_dim_and_custom_scale():
    _check(*_qkv(1, 19, 19, 2, 1, 24, torch.float32), torch.float32, causal=True, softmax_scale=0.3)


@needs_interpreter
def test_attention_accepts_sequence_first_views():
    _check(*_qkv(2, 17, 17, 2, 1, 16, torch.float32, seq_first=True), torch.float32, causal=True)


@needs_interpreter
def test_varlen_attention_matches_reference():
    torch.manual_seed(0)
    lengths = [5, 17, 40]
    cu = torch.tensor([0, 5, 22, 62], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, 16) for h in (4, 2, 2))
    _check(q, k, v, torch.float32, causal=True, cu_seqlens=cu, max_seqlen=40)


@needs_interpreter
def test_attention_in_half_precision_matches_reference():
    _check(*_qkv(1, 32, 32, 2, 1, 16, torch.float16), torch.float16, causal=True)


def test_reference_matches_torch_sdpa():
    q, k, v = _qkv(2, 9, 9, 4, 2, 8, torch.float64)
    out = attention_reference(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                          v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True)
    assert_rel(out, sdpa.transpose(1, 2), torch.float64, "reference")


@pytest.mark.parametrize("kwargs, message", [
    (dict(heads=(6, 4)), r"heads_q=6 is not divisible by heads_kv=4"),
    (dict(cu=torch.tensor([0, 4])), r"cu_seqlens dtype torch.int64 must be torch.int32"),
])
def test_attention_rejects_bad_inputs(kwargs, message):
    hq, hkv = kwargs.get("heads", (2, 2))
    cu = kwargs.get("cu")
    shape = (4,) if cu is not None else (1, 4)
    q, k = torch.randn(*shape, hq, 8), torch.randn(*shape, hkv, 8)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, cu_seqlens=cu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, head_dim, causal", [
    (torch.bfloat16, 64, False), (torch.bfloat16, 64, True), (torch.bfloat16, 128, False),
    (torch.bfloat16, 128, True), (torch.float16, 128, True)])
def test_attention_matches_reference_on_gpu(dtype, head_dim, causal):
    _check(*_qkv(2, 1000, 1000, 8, 2, head_dim, dtype, DEVICE), dtype, causal=causal)


@pytest.mark.gpu
def test_varlen_attention_matches_reference_on_gpu():
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 613, 1500, 2048], dtype=torch.int32, device=DEVICE)
    q, k, v = (torch.randn(2048, h, 128, device=DEVICE, dtype=torch.bfloat16) for h in (8, 2, 2))
    _check(q, k, v, torch.bfloat16, causal=True, cu_seqlens=cu, max_seqlen=887)


@pytest.mark.gpu
def test_attention_head_dim_96_and_seq_first_views_on_gpu():
    _check(*_qkv(2, 300, 300, 4, 4, 96, torch.bfloat16, DEVICE, seq_first=True), torch.bfloat16, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [8, 2, 1], ids=["mha", "gqa", "mqa"])
def test_auto_backend_attention_matches_reference_on_gpu(causal, heads_kv):
    q, k, v = _qkv(2, 512, 512, 8, heads_kv, 128, torch.bfloat16, DEVICE)
    grad_out = [torch.randn_like(q)]
    fn = lambda q, k, v: flash_attention(q, k, v, causal=causal)  # noqa: E731
    outs, grads = run_with_grads(fn, [q, k, v], grad_out, backend="auto")
    ref_outs, ref_grads = float64_twin(fn, [q, k, v], grad_out)
    assert_rel(outs[0], ref_outs[0], torch.bfloat16, "out")
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_rel(g, r, torch.bfloat16, f"d{name}")


@pytest.mark.gpu
def test_gqa_runs_on_cudnn_on_gpu():
    # llama-1b's layout (8 q heads per kv head, head_dim 64): the auto backend's fast path must accept it
    from tpflash.kernels.attention import _cudnn_sdpa
    q, k, v = _qkv(2, 256, 256, 32, 4, 64, torch.bfloat16, DEVICE)
    assert _cudnn_sdpa(q, k, v, True, 0.125, None, False) is not None, "cuDNN declined GQA"


def test_a_configuration_cudnn_declines_is_asked_once_and_said(monkeypatch):
    # the auto backend's fast path: a decline falls back to Triton, with one warning, and the same
    # configuration is not retried (an exception per call would cost every step)
    from tpflash.kernels import attention
    calls = []

    def declining_sdpa(*args, **kwargs):
        calls.append(kwargs)
        raise RuntimeError("No available kernel. Aborting execution.")
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", declining_sdpa)
    monkeypatch.setattr(attention, "_CUDNN_DECLINED", set())
    q, k, v = _qkv(2, 16, 16, 8, 2, 64, torch.bfloat16)
    with pytest.warns(UserWarning, match=r"cuDNN declined q \(2, 16, 8, 64\), k \(2, 16, 2, 64\)"):
        assert attention._cudnn_sdpa(q, k, v, True, 0.125, None, False) is None
    assert attention._cudnn_sdpa(q, k, v, True, 0.125, None, False) is None
    assert len(calls) == 1 and calls[0]["enable_gqa"] is True
