"""GPT under context parallelism equals the same GPT without it (same seed): loss, logits, every
gradient and a 20-step AdamW curve, at cp 2 and (cp=2, tp=2), ring and all-gather; the activation
memory a cp rank saves for backward falls as 1/cp; bad cp inputs are one clear error."""
import pytest
import torch
import torch.distributed as dist

import tpflash
from tests.distributed.checks import assert_close
from tests.distributed.test_gpt import twin_models
from tests.kernels.helpers import needs_interpreter
from tests.models.reference import assert_grad_close, full_grads
from tpflash.kernels import use_backend
from tpflash.models import GPT, GPTConfig
from tpflash.parallel import comm
from tpflash.parallel.zigzag import zigzag_shard

pytestmark = pytest.mark.cpu_ranks

VOCAB, SEQ, BATCH = 101, 16, 2


def tiny_config(family="llama", sequence_parallel=False, **kw):
    base = "gpt2-tiny" if family == "gpt2" else "llama-tiny"
    size = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=32, n_head=4,
                n_kv_head=None if family == "gpt2" else 2, ffn_hidden=64, sequence_parallel=sequence_parallel)
    return GPTConfig.preset(base, **{**size, **kw})


def batch(seed=1):
    torch.manual_seed(seed)  # the same whole sequences on every rank
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets[0, :3] = -100  # uneven counted tokens across cp ranks: the mean must still be global
    return idx, targets


def average_grads_over_cp(model, ps):
    """What FSDP / DDP over the dp x cp ranks do to the gradients (here dp = 1)."""
    for p in model.parameters():
        dist.all_reduce(p.grad, group=ps.cp_group)
        p.grad /= ps.cp_size


def equal_body(tp, cp, family, sequence_parallel, cp_comm):
    ps = tpflash.parallel.init(tp=tp, cp=cp)
    model, single = twin_models(ps, tiny_config(family, sequence_parallel), cp_comm=cp_comm)
    idx, targets = batch()
    logits = comm.all_gather(model(idx).detach().contiguous(), -1, ps.tp_group)[..., :VOCAB]
    assert_close(logits, zigzag_shard(single(idx), 1, ps.cp_rank, cp), "this cp rank's logits")
    loss, ref_loss = model(idx, targets), single(idx, targets)
    assert_close(loss, ref_loss, "loss")
    loss.backward()
    ref_loss.backward()
    average_grads_over_cp(model, ps)
    ref_grads = dict(single.named_parameters())
    for name, g in full_grads(model).items():
        assert_grad_close(g, ref_grads[name].grad, f"grad of {name}")


def curve_body(tp, cp, cp_comm, steps=20):
    """Per-step |loss(cp) - loss(one process)| over `steps` AdamW steps."""
    ps = tpflash.parallel.init(tp=tp, cp=cp)
    model, single = twin_models(ps, tiny_config(), cp_comm=cp_comm)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, single)]
    gaps, losses = [], []
    for step in range(steps):
        idx, targets = batch(seed=100 + step % 2)
        losses = []
        for m, opt in zip((model, single), opts):
            opt.zero_grad()
            loss = m(idx, targets)
            loss.backward()
            if m is model:
                average_grads_over_cp(model, ps)
            opt.step()
            losses.append(loss.item())
        gaps.append(abs(losses[0] - losses[1]))
    return gaps, losses


@pytest.mark.parametrize("cp_comm", ["ring", "allgather"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpt_at_cp2_matches_one_process(ranks, family, cp_comm):
    ranks(2).run(equal_body, 1, 2, family, False, cp_comm)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_at_cp2_tp2_matches_one_process(ranks, sequence_parallel):
    ranks(4).run(equal_body, 2, 2, "llama", sequence_parallel, "ring")


def test_gpt_at_cp4_matches_one_process(ranks):
    ranks(4).run(equal_body, 1, 4, "llama", False, "ring")


@pytest.mark.parametrize("tp,cp,cp_comm", [(1, 2, "ring"), (2, 2, "ring"), (1, 2, "allgather")])
def test_training_curve_at_cp_matches_one_process(ranks, tp, cp, cp_comm):
    for gaps, losses in ranks(tp * cp).run(curve_body, tp, cp, cp_comm):
        assert max(gaps) < 1e-5, gaps
        assert losses[0] < 4.0  # it learned: ln(101) = 4.6 at the start


def saved_activation_bytes(cp, seq=56):
    """Bytes of activations this rank saves for backward in one training forward: saved tensors with a
    dimension of this rank's token count (seq/cp; 56 keeps it unequal to every weight dimension, and
    short, since the kernels run interpreted), so
    that the stacked weight copies the GEMMs save, the same at any cp, are left out.
    The kernels run as on a GPU (Triton, interpreted on CPU): at cp=1 flash attention saves q, k, v, out
    and lse as the ring does, where the CPU reference would save the [seq, seq] probabilities."""
    ps = tpflash.parallel.init(tp=1, cp=cp) if cp > 1 else None
    torch.manual_seed(0)
    model = GPT(tiny_config(block_size=seq, n_embd=32, n_head=2, n_kv_head=2, vocab_size=64, n_layer=1))
    tokens, seen, total = seq // cp, set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if tokens in t.shape and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    idx = torch.randint(0, 64, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), use_backend("triton"):
        loss = model(idx, idx)
    loss.backward()
    del ps
    return total[0]


@needs_interpreter
def test_saved_activations_per_rank_fall_as_one_over_cp(ranks):
    whole = saved_activation_bytes(1)
    for cp in (2, 4):
        per_rank = ranks(cp).run(saved_activation_bytes, cp)
        for got in per_rank:
            assert abs(got * cp / whole - 1) < 0.1, (cp, got, whole)


def bad_sequence_body():
    tpflash.parallel.init(tp=1, cp=2)
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2\*cp=4"):
        model(torch.zeros(1, 6, dtype=torch.long))
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed documents \(cu_seqlens\) are not supported under context"):
        model(torch.zeros(1, 8, dtype=torch.long), cu_seqlens=cu)
    with pytest.raises(ValueError, match="CUDA graphs are not captured under context parallelism"):
        model.capture_cuda_graphs(1, 8)


def test_bad_inputs_under_cp_are_one_clear_error_before_any_collective(ranks):
    ranks(2).run(bad_sequence_body)
