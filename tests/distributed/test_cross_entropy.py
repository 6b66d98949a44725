"""vocab_parallel_cross_entropy equals F.cross_entropy on the full logits, value and gradient, tp in {2, 4}."""
import pytest
import torch
import torch.nn.functional as F

from tests.distributed.checks import assert_close, init_tp, work_dtype
from tpflash.losses import vocab_parallel_cross_entropy

TOKENS, VOCAB = 12, 16


def _logits_and_target(ps, dtype, vocab, scale=3.0):
    torch.manual_seed(7)  # same data on every rank
    logits = (torch.randn(TOKENS, vocab, device=ps.device) * scale).to(dtype)
    target = torch.randint(0, vocab, (TOKENS,), device=ps.device)
    target[::4] = -100  # ignored tokens
    return logits, target


def _local_columns(ps, logits, tp, padded):
    """This rank's shard of the logits padded (with junk, which must be ignored) to `padded` columns."""
    junk = torch.full((logits.shape[0], padded - logits.shape[1]), 50.0, device=logits.device, dtype=logits.dtype)
    full = torch.cat([logits, junk], dim=1)
    width = padded // tp
    return full[:, ps.tp_rank * width:(ps.tp_rank + 1) * width]


def cross_entropy_body(tp, reduction, label_smoothing, z_loss, vocab, scale):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    logits, target = _logits_and_target(ps, dtype, vocab, scale)
    padded = -(-vocab // tp) * tp
    local = _local_columns(ps, logits, tp, padded).clone().requires_grad_()
    ref_in = logits.clone().float().requires_grad_()

    loss = vocab_parallel_cross_entropy(local, target, reduction=reduction, label_smoothing=label_smoothing,
                                        z_loss=z_loss, vocab_size=vocab if padded != vocab else None)
    ref = F.cross_entropy(ref_in, target, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(ref_in, dim=-1)
        valid = target != -100
        ref = ref + z_loss * (lse.square() * valid).sum() / valid.sum()
    assert_close(loss.float(), ref, "loss", tol=1e-5 if dtype == torch.float32 else 1e-2)
    torch.manual_seed(3)
    g = torch.rand_like(ref)
    loss.backward(g.to(loss.dtype))
    ref.backward(g)
    cols = slice(ps.tp_rank * (padded // tp), (ps.tp_rank + 1) * (padded // tp))
    ref_grad = torch.cat([ref_in.grad, torch.zeros(TOKENS, padded - vocab, device=ps.device)], dim=1)[:, cols]
    assert local.grad.dtype == local.dtype
    assert_close(local.grad, ref_grad, "logits grad")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch_for_each_reduction(ranks, tp, reduction):
    ranks(tp).run(cross_entropy_body, tp, reduction, 0.0, 0.0, VOCAB, 3.0)


@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_label_smoothing_matches_torch(ranks, tp):
    ranks(tp).run(cross_entropy_body, tp, "mean", 0.1, 0.0, VOCAB, 3.0)


@pytest.mark.parametrize("tp", [2, 4])
def test_z_loss_adds_mean_squared_logsumexp(ranks, tp):
    ranks(tp).run(cross_entropy_body, tp, "mean", 0.0, 1e-3, VOCAB, 3.0)


@pytest.mark.parametrize("tp", [2, 4])
def test_padding_columns_never_win_the_softmax(ranks, tp):
    ranks(tp).run(cross_entropy_body, tp, "mean", 0.1, 1e-3, 13, 3.0)  # 13 -> 14 / 16 columns


@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_is_stable_for_logits_of_magnitude_1e4(ranks, tp):
    ranks(tp).run(cross_entropy_body, tp, "mean", 0.0, 0.0, VOCAB, 1e4)


def test_cross_entropy_is_stable_in_bf16():
    torch.manual_seed(0)
    logits = (torch.randn(64, 100) * 30).bfloat16().requires_grad_()
    target = torch.randint(0, 100, (64,))
    loss = vocab_parallel_cross_entropy(logits, target)
    ref = F.cross_entropy(logits.detach().float().requires_grad_(), target)
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) / ref.item() < 1e-3
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_cross_entropy_without_group_equals_torch():
    torch.manual_seed(0)
    logits = torch.randn(10, 9, requires_grad=True)
    target = torch.randint(0, 9, (10,))
    target[0] = -100
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.2)
    ref = F.cross_entropy(logits, target, label_smoothing=0.2)
    assert torch.allclose(loss, ref, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(reduction="avg"), r"reduction='avg' must be one of"),
    (dict(label_smoothing=1.5), r"label_smoothing=1.5 must be in \[0, 1\]"),
    (dict(z_loss=-1.0), r"z_loss=-1.0 must be >= 0"),
    (dict(vocab_size=20), r"vocab_size=20 must be in \[1, 9\]"),
])
def test_cross_entropy_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vocab_parallel_cross_entropy(torch.randn(4, 9), torch.zeros(4, dtype=torch.long), **kwargs)


def test_cross_entropy_rejects_out_of_range_targets():
    with pytest.raises(ValueError, match=r"target 9 is outside \[0, 9\)"):
        vocab_parallel_cross_entropy(torch.randn(2, 9), torch.tensor([0, 9]))
