"""fused_linear_cross_entropy equals F.cross_entropy(hidden @ W.T), value and gradients, tp in {1, 2, 4}."""
import pytest
import torch
import torch.nn.functional as F

from tests.distributed.checks import assert_close, init_tp
from tpflash.layers.embedding import padded_vocab_size
from tpflash.losses import fused_linear_cross_entropy

SEQ, BATCH, HIDDEN, VOCAB = 4, 3, 16, 30  # hidden [seq, batch, hidden] (sequence-first)


def _data(device, dtype, vocab=VOCAB):
    torch.manual_seed(11)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, device=device).to(dtype)
    weight = (torch.randn(vocab, HIDDEN, device=device) / HIDDEN ** 0.5).to(dtype)
    target = torch.randint(0, vocab, (SEQ, BATCH), device=device)
    target[0, :2] = -100
    return hidden, weight, target


def _reference(hidden, weight, target, reduction, label_smoothing=0.0):
    """(loss, d hidden, d weight) of the naive path in fp32, for upstream gradient g (fixed seed)."""
    h, w = hidden.detach().float().clone().requires_grad_(), weight.detach().float().clone().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).flatten(0, -2), target.flatten(), reduction=reduction,
                           label_smoothing=label_smoothing)
    loss = loss.reshape(target.shape) if reduction == "none" else loss
    g = torch.rand(loss.shape, generator=torch.Generator().manual_seed(5)).to(loss.device)
    loss.backward(g)
    return loss, h.grad, w.grad, g


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_linear_cross_entropy_matches_torch(reduction):
    hidden, weight, target = _data("cpu", torch.float32)
    ref, ref_dh, ref_dw, g = _reference(hidden, weight, target, reduction, 0.1)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, target, reduction=reduction, chunk_size=5, label_smoothing=0.1)
    loss.backward(g)
    assert_close(loss, ref, "loss")
    assert_close(h.grad, ref_dh, "d hidden")
    assert_close(w.grad, ref_dw, "d weight")


def _fused_under_autocast(hidden, weight, target, chunk_size, g):
    """(loss, d hidden, d weight) of the fused loss on fp32 leaves under CPU bf16 autocast, upstream g."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(h, w, target, chunk_size=chunk_size)
    loss.backward(g)
    return loss, h.grad, w.grad


def test_fused_linear_cross_entropy_under_autocast_computes_in_bf16_with_fp32_weight_grads():
    """Under autocast the GEMMs run in bf16 as F.linear's would (the loss is autocast's unfused one),
    and d weight reaches the fp32 parameter in fp32, summed over the chunks without rounding: one
    token per chunk gives what one chunk of all tokens gives, to fp32 accuracy."""
    hidden, weight, target = _data("cpu", torch.float32)
    ref, ref_dh, ref_dw, g = _reference(hidden.bfloat16(), weight.bfloat16(), target, "mean")
    loss, dh, dw = _fused_under_autocast(hidden, weight, target, 1, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)  # bf16, as each chunk's
    assert_close(loss, F.cross_entropy(logits.float().flatten(0, -2), target.flatten()), "loss", 1e-6)
    assert (dh.dtype, dw.dtype) == (torch.float32, torch.float32)
    assert_close(dw, ref_dw, "d weight", 2e-2)
    assert_close(dh, ref_dh, "d hidden", 2e-2)
    _, dh_one, dw_one = _fused_under_autocast(hidden, weight, target, target.numel(), g)
    assert_close(dw, dw_one, "d weight, 1-token chunks vs one chunk", 1e-6)


def test_fused_linear_cross_entropy_without_grad_gives_the_loss():
    hidden, weight, target = _data("cpu", torch.float32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, target, chunk_size=7)
    assert_close(loss, _reference(hidden, weight, target, "mean")[0], "loss")


def _weight_shard(weight, vocab, tp, rank):
    """This rank's rows of the vocabulary padded to tp shards, and the padded size."""
    padded = padded_vocab_size(vocab, tp)
    rows = padded // tp
    full_w = torch.cat([weight, weight.new_zeros(padded - vocab, HIDDEN)])
    return full_w[rank * rows:(rank + 1) * rows].clone().requires_grad_(), padded


def _assert_weight_grad(w, ref_dw, vocab, padded, tp, rank, tol):
    rows = padded // tp
    ref_dw = torch.cat([ref_dw, ref_dw.new_zeros(padded - vocab, HIDDEN)])[rank * rows:(rank + 1) * rows]
    assert_close(w.grad, ref_dw, "d weight", tol)


def vocab_parallel_body(tp, reduction, vocab, sequence_parallel, chunk_size=5):
    ps = init_tp(tp)
    dtype = torch.float32 if ps.device.type == "cpu" else torch.bfloat16
    hidden, weight, target = _data(ps.device, dtype, vocab)
    ref, ref_dh, ref_dw, g = _reference(hidden, weight, target, reduction)
    w, padded = _weight_shard(weight, vocab, tp, ps.tp_rank)
    seq = hidden.shape[0] // tp if sequence_parallel else hidden.shape[0]
    start = ps.tp_rank * seq if sequence_parallel else 0
    h = hidden[start:start + seq].clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, target, vocab_size=vocab, reduction=reduction, chunk_size=chunk_size,
                                      sequence_parallel=sequence_parallel)
    loss.backward(g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(loss.float(), ref, "loss", tol)
    assert_close(h.grad, ref_dh[start:start + seq], "d hidden", tol)
    _assert_weight_grad(w, ref_dw, vocab, padded, tp, ps.tp_rank, tol)


def batch_first_body(tp, reduction):
    """hidden [batch, seq/tp, H] with seq_dim=1: the loss runs sequence-first and gives the same values."""
    ps = init_tp(tp)
    dtype = torch.float32 if ps.device.type == "cpu" else torch.bfloat16
    hidden, weight, target = _data(ps.device, dtype)
    ref, ref_dh, ref_dw, g = _reference(hidden, weight, target, reduction)
    w, padded = _weight_shard(weight, VOCAB, tp, ps.tp_rank)
    seq = SEQ // tp
    start = ps.tp_rank * seq
    h = hidden.transpose(0, 1)[:, start:start + seq].clone().requires_grad_()  # [batch, seq/tp, H]
    loss = fused_linear_cross_entropy(h, w, target.t(), vocab_size=VOCAB, reduction=reduction, chunk_size=5,
                                      sequence_parallel=True, seq_dim=1)
    per_token = reduction == "none"
    loss.backward(g.t() if per_token else g)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(loss.float(), ref.t() if per_token else ref, "loss", tol)
    assert_close(h.grad, ref_dh.transpose(0, 1)[:, start:start + seq], "d hidden", tol)
    _assert_weight_grad(w, ref_dw, VOCAB, padded, tp, ps.tp_rank, tol)


def own_rows_first_body(tp):
    """The logits GEMM takes this rank's own rows before any peer's (they need no transfer), then the
    next ranks' in turn, each once."""
    from tpflash.parallel import overlap_transfers
    asked, real = [], overlap_transfers.all_gather

    class Recorded:
        def __init__(self, gather):
            self.gather = gather

        def __getattr__(self, name):
            return getattr(self.gather, name)

        def piece(self, r):
            asked.append(r)
            return self.gather.piece(r)

    overlap_transfers.all_gather = lambda *a, **k: Recorded(real(*a, **k))
    try:
        vocab_parallel_body(tp, "mean", VOCAB, True, chunk_size=SEQ * BATCH)  # one chunk of every token
    finally:
        overlap_transfers.all_gather = real
    rank = torch.distributed.get_rank()
    expected = [(rank + step) % tp for step in range(tp)]
    assert asked == expected, f"rank {rank} multiplied the ranks' rows in the order {asked}, not {expected}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vocab_parallel_fused_linear_cross_entropy_matches_one_process(ranks, tp, reduction):
    ranks(tp).run(vocab_parallel_body, tp, reduction, 29, False)  # 29 -> padded 30 / 32


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_sequence_parallel_fused_linear_cross_entropy_matches_one_process(ranks, tp, reduction):
    """d hidden formed in the forward ("mean", "sum") is reduce-scattered there, beside the last
    chunk's d weight GEMM, and scaled by the upstream gradient in the backward; "none" forms and
    reduce-scatters it in the backward."""
    ranks(tp).run(vocab_parallel_body, tp, reduction, VOCAB, True)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_sequence_parallel_fused_linear_cross_entropy_batch_first_matches_one_process(ranks, tp, reduction):
    ranks(tp).run(batch_first_body, tp, reduction)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_fused_linear_cross_entropy_multiplies_its_own_rows_first(ranks, tp):
    ranks(tp).run(own_rows_first_body, tp)


def test_fused_linear_cross_entropy_rejects_the_feature_dim_as_sequence_dim(ranks):
    ranks(2).run(feature_dim_body)


def feature_dim_body():
    init_tp(2)
    with pytest.raises(ValueError, match=r"seq_dim=-1 names hidden's feature dimension"):
        fused_linear_cross_entropy(torch.randn(2, 3, HIDDEN), torch.randn(16, HIDDEN),
                                   torch.zeros(4, 3, dtype=torch.long), sequence_parallel=True, seq_dim=-1)


def test_fused_linear_cross_entropy_rejects_a_mismatched_weight():
    with pytest.raises(ValueError, match=r"weight_shard shape \(30, 8\) must be \[V/tp, hidden=16\]"):
        fused_linear_cross_entropy(torch.randn(4, 16), torch.randn(30, 8), torch.zeros(4, dtype=torch.long))


@pytest.mark.gpu
def test_fused_linear_cross_entropy_matches_torch_on_gpu():
    torch.manual_seed(0)
    hidden = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(32000, 1024, device="cuda") / 32).to(torch.bfloat16)
    target = torch.randint(0, 32000, (4096,), device="cuda")
    ref, ref_dh, ref_dw, g = _reference(hidden, weight, target, "mean")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h, w, target, chunk_size=1024)
    loss.backward(g)
    assert_close(loss.float(), ref, "loss", 1e-2)
    assert_close(h.grad, ref_dh, "d hidden", 2e-2)
    assert_close(w.grad, ref_dw, "d weight", 2e-2)


def copy_engine_body(tp, entry):
    """On GPUs that map each other's memory the copy engines carry the loss's collectives, taking no SMs
    from the GEMMs they travel beside: `entry` is the peer_collectives function that starts one
    (start_reduce_scatter: d hidden's reduce-scatter, beside the last d weight GEMM; PeerAllGather:
    hidden's all-gather, beside the logits GEMM of this rank's rows). On gloo ranks (CPU, also on a
    machine of one GPU) the group's own collectives do."""
    from tpflash.parallel import peer_collectives
    started, real = [], getattr(peer_collectives, entry)
    setattr(peer_collectives, entry, lambda *a, **k: started.append(1) or real(*a, **k))
    try:
        vocab_parallel_body(tp, "mean", VOCAB, True)
    finally:
        setattr(peer_collectives, entry, real)
    on_gpus = torch.distributed.get_backend() == "nccl"
    assert bool(started) == on_gpus, f"{entry} started {len(started)} copy-engine collectives"


COLLECTIVES = pytest.mark.parametrize("entry", ["start_reduce_scatter", "PeerAllGather"],
                                      ids=["d-hidden-reduce-scatter", "hidden-all-gather"])


@COLLECTIVES
def test_sequence_parallel_fused_linear_cross_entropy_collectives_use_the_groups_own_on_cpu(ranks, entry):
    ranks(2).run(copy_engine_body, 2, entry)


@pytest.mark.gpu
@COLLECTIVES
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_fused_linear_cross_entropy_collectives_go_through_the_copy_engines(ranks, tp, entry):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(copy_engine_body, tp, entry)
