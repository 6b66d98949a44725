"""ShardedOptimizerState (fsdp=zero1): AdamW's state sharded over dp, parameters in place, training equal to DDP."""
import pytest
import torch

from tests.checkpoint.tiny_model import batch, build, full_state, make_optimizer, BATCH
from tests.distributed.checks import assert_close, init_layout, init_tp
from tpflash.parallel import ShardedOptimizerState, replicate_over_dp
from tpflash.parallel.zero import bytes_per_param
from tpflash.parallel.zero_buckets import assign_owners, split_unbalanced
from tpflash.train.gradients import clipped_step, global_grad_norm

pytestmark = pytest.mark.cpu_ranks  # the tiny models live on CPU: gloo even where GPUs are visible

STEPS = 20
CLIP = 0.5  # low enough that the tiny model's steps are clipped: the norm over owned gradients is tested too


def test_owners_balance_the_ranks_within_one_tensor():
    sizes = [1000, 10, 400, 400, 64, 64, 300, 7]
    owners = assign_owners(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes), loads
    assert owners == assign_owners(sizes, 3), "the assignment must be the same on every rank"


def test_tensors_too_large_to_balance_leave_the_equal_segments_largest_first():
    embedding, head, norm = 128256 * 4096, 128256 * 4096, 4096
    assert split_unbalanced([embedding, head, norm], 4) == [0, 1], "each would pad the others' segments to its size"
    assert split_unbalanced([embedding, head, norm], 2) == [], "two ranks, one each: balanced"
    assert split_unbalanced([embedding, norm], 2) == [0], "alone, a large tensor takes a segment per rank"
    llama_block = [4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 14336 * 4096, 14336 * 4096, 4096 * 14336,
                   4096, 4096]
    assert split_unbalanced(llama_block, 4) == [], "a block's tensors balance four ranks within a quarter"
    assert split_unbalanced([1000, 10], 2) == [], "small tensors stay in the bucket, padded"
    assert split_unbalanced([embedding], 1) == []


def test_zero1_memory_per_parameter_is_weights_gradients_and_a_dp_share_of_adam():
    assert bytes_per_param(1) == 16 and bytes_per_param(4) == 10


def _zero1_step(model, zero, optimizer, ps, loss):
    loss.backward()
    zero.reduce_gradients()
    norm = global_grad_norm(model, ps.tp_group, ps.dp_cp_group, True, params=zero.owned_params)
    zero.step(lambda: clipped_step(optimizer, zero.owned_params, norm, CLIP))
    zero.zero_grad()
    return norm


def _ddp_step(model, ddp, optimizer, ps, loss):
    loss.backward()
    norm = global_grad_norm(model, ps.tp_group, ps.dp_cp_group, False)
    clipped_step(optimizer, model.parameters(), norm, CLIP)
    optimizer.zero_grad(set_to_none=True)
    return norm


def _train(step_fn, forward, model, wrapper, optimizer, ps, data_rank, data_ranks, accum=1, steps=STEPS):
    """`steps` steps on this rank's rows of each global batch, in `accum` micro-batches; the norms."""
    norms = []
    per_rank = BATCH // data_ranks
    device = next(model.parameters()).device
    for step in range(steps):
        ids, targets = (t.to(device) for t in batch(step))
        rows = range(data_rank * per_rank, (data_rank + 1) * per_rank)
        micro = per_rank // accum
        for i in range(accum - 1):  # all but the last micro-batch: backward only, gradients accumulate
            r = slice(rows[i * micro], rows[i * micro] + micro)
            (forward(ids[r], targets[r]) / accum).backward()
        r = slice(rows[(accum - 1) * micro], rows[-1] + 1)
        norms.append(step_fn(model, wrapper, optimizer, ps, forward(ids[r], targets[r]) / accum).item())
    return norms


def equals_ddp_body(tp, cp, accum):
    ps = init_layout(tp, cp) if cp > 1 else init_tp(tp)
    model, reference = build(seed=0), build(seed=0)
    zero = ShardedOptimizerState(model, ps)
    ddp = replicate_over_dp(reference, ps)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    addresses = [p.data_ptr() for p in model.parameters()]
    rank, ranks = ps.dp_cp_rank, ps.dp_cp_size
    norms = _train(_zero1_step, model, model, zero, optimizer, ps, rank, ranks, accum)
    ref_norms = _train(_ddp_step, ddp, reference, ddp, ref_optimizer, ps, rank, ranks, accum)
    assert_close(torch.tensor(norms), torch.tensor(ref_norms), "grad-norm curve", tol=1e-5)
    assert min(norms) > CLIP, "every step must be clipped for the test to cover the clip"
    assert [p.data_ptr() for p in model.parameters()] == addresses, "parameters moved (graphs would replay stale ones)"
    for name, p in model.named_parameters():  # after the all-gather every rank holds every updated parameter
        assert_close(p, dict(reference.named_parameters())[name], name, tol=1e-5)
    owned = set(zero.owned_names)
    got, expected = full_state(model, optimizer), full_state(reference, ref_optimizer)
    for name in dict(model.named_parameters()):
        if name in owned:  # this rank's state equals DDP's; the others' it does not hold
            assert_close(got[f"{name}.exp_avg_sq"], expected[f"{name}.exp_avg_sq"], name, tol=1e-5)
        else:
            assert f"{name}.exp_avg" not in got, f"rank {rank} holds AdamW state of {name}, owned elsewhere"
    return sorted(owned)


@pytest.mark.parametrize("tp,cp,accum", [(1, 1, 1), (2, 1, 2), (1, 2, 1)], ids=["dp4", "dp2-tp2-accum2", "dp2-cp2"])
def test_zero1_trains_like_ddp_for_20_steps(ranks, tp, cp, accum):
    owned = ranks(4).run(equals_ddp_body, tp, cp, accum)
    dp_peers = [owned[r] for r in range(0, 4, tp)]  # the ranks of tp rank 0 split its parameters among them
    assert sorted(n for names in dp_peers for n in names) == sorted(set(n for names in dp_peers for n in names))
    assert all(dp_peers), "every dp rank owns some parameters"


def memory_body():
    ps = init_tp(1)
    model = build(seed=0)
    n = sum(p.numel() for p in model.parameters())
    zero = ShardedOptimizerState(model, ps)
    optimizer = make_optimizer(model)
    _train(_zero1_step, model, model, zero, optimizer, ps, ps.dp_rank, ps.dp_size)
    held = zero.bytes_per_rank()
    adam = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if v.dim())
    total_adam = torch.tensor(adam)
    torch.distributed.all_reduce(total_adam)
    return n, held, adam, int(total_adam)


def test_zero1_holds_weights_gradients_and_a_dp_share_of_the_adam_state(ranks):
    results = ranks(4).run(memory_body)
    n = results[0][0]
    for _, held, adam, total_adam in results:
        assert held["adam_state"] == adam, "the formula counts the state AdamW actually holds"
        assert total_adam == 8 * n, "each parameter's moments are held by exactly one rank"
        # weights and gradients: the whole model each, plus at most the alignment padding of its tensors
        assert 4 * n <= held["params"] <= 4 * (n + 64 * 4 * len(list(build().parameters())))
        assert held["grads"] == held["params"]
        assert adam < 8 * n * 0.6, f"a rank of 4 holds {adam} of {8 * n} bytes of AdamW state"



def embedding_heavy_body():
    from tpflash.models import GPT, GPTConfig
    ps = init_tp(1)
    torch.manual_seed(0)
    # embedding and output layer of 2M elements each (large enough to leave their buckets), blocks of 12K
    model = GPT(GPTConfig.preset("gpt2-tiny", vocab_size=65536, block_size=16, n_layer=2, n_embd=32, n_head=4,
                                 ffn_hidden=64, tie_embeddings=False))
    n = sum(p.numel() for p in model.parameters())
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    zero = ShardedOptimizerState(model, ps)
    grads = {name: torch.full_like(p, float(ps.dp_rank + 1)) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad.copy_(grads[name])
    zero.reduce_gradients()
    averaged = {name: p.grad.clone() for name, p in model.named_parameters() if name in zero.owned_names}
    zero.step(lambda: [p.data.add_(1.0) for p in zero.owned_params])
    changed = {name: bool((p != reference[name] + 1).any()) for name, p in model.named_parameters()}
    return n, zero.bytes_per_rank()["params"], averaged, changed, sorted(zero.owned_names)


def test_an_embedding_heavy_model_at_dp4_holds_its_weights_once_with_no_segment_padding(ranks):
    results = ranks(4).run(embedding_heavy_body)
    n = results[0][0]
    for _, held, averaged, changed, _ in results:
        assert held <= 4 * n * 1.05, f"{held} bytes of flat weights for {4 * n} bytes of parameters"
        for name, grad in averaged.items():  # ranks give 1, 2, 3, 4: the average is 2.5 everywhere
            assert torch.equal(grad, torch.full_like(grad, 2.5)), name
        assert not any(changed.values()), "every rank holds every owner's update after the gather"
    owned = [names for *_, names in results]
    every = sorted(n for names in owned for n in names)
    assert every == sorted(set(every)) and len(every) == len(changed), "each parameter has exactly one owner"
