"""GPT at tp in {2, 4} equals the same GPT at tp=1 (same seed): initial weights, logits, loss,
gradients and a 20-step AdamW loss curve, for the GPT-2 and Llama families, with and without SP."""
import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tests.models.reference import assert_grad_close, full_grads
from tpflash.models import GPT, GPTConfig
from tpflash.parallel import comm, full_state_dict, set_default_state

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

VOCAB, SEQ, BATCH = 101, 8, 2  # 101: the vocab is padded at tp 2 and 4


def tiny_config(family, sequence_parallel=False, **kw):
    base = "gpt2-tiny" if family == "gpt2" else "llama-tiny"
    size = dict(n_head=4, n_kv_head=None if family == "gpt2" else 2, ffn_hidden=64)
    return GPTConfig.preset(base, vocab_size=VOCAB, block_size=16, n_layer=2, n_embd=32,
                            sequence_parallel=sequence_parallel, **{**size, **kw})


def twin_models(ps, config, **gpt_kwargs):
    """(model over the default state's groups, the same model in one process), built after the same
    seed; gpt_kwargs go to the first (e.g. cp_comm)."""
    torch.manual_seed(0)
    model = GPT(config, **gpt_kwargs)
    set_default_state(None)
    torch.manual_seed(0)
    single = GPT(config)
    set_default_state(ps)
    return model, single


def batch(seed=1):
    torch.manual_seed(seed)  # the same tokens on every rank
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets[0, :2] = -100
    return idx, targets


def full_logits(model, idx):
    """[batch, seq, vocab]: the vocab shards gathered, padding columns dropped."""
    return comm.all_gather(model(idx).detach().contiguous(), -1, model.process_group)[..., :VOCAB]


def equal_body(tp, family, sequence_parallel, fused_loss=True):
    ps = init_tp(tp)
    model, single = twin_models(ps, tiny_config(family, sequence_parallel, fused_loss=fused_loss))
    full, ref = full_state_dict(model), single.state_dict()
    assert full.keys() == ref.keys()
    for key in ref:
        assert torch.equal(full[key], ref[key]), f"initial {key} differs from the tp=1 model's"
    assert model.num_params() == single.num_params() and model.flops_per_token(SEQ) == single.flops_per_token(SEQ)
    idx, targets = batch()
    logits = model(idx)
    assert logits.shape == (BATCH, SEQ, -(-VOCAB // tp))
    assert_close(full_logits(model, idx), single(idx), "logits")
    loss, ref_loss = model(idx, targets), single(idx, targets)
    assert_close(loss, ref_loss, "loss")
    loss.backward()
    ref_loss.backward()
    ref_grads = dict(single.named_parameters())
    for name, g in full_grads(model).items():
        assert_grad_close(g, ref_grads[name].grad, f"grad of {name}")


def curve_body(tp, family, sequence_parallel, steps=20):
    """Per-step |loss(tp) - loss(tp=1)| over `steps` AdamW steps."""
    ps = init_tp(tp)
    model, single = twin_models(ps, tiny_config(family, sequence_parallel))
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, single)]
    gaps = []
    for step in range(steps):
        idx, targets = batch(seed=100 + step % 2)  # two batches to memorise: the loss must fall
        losses = []
        for m, opt in zip((model, single), opts):
            opt.zero_grad()
            loss = m(idx, targets)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        gaps.append(abs(losses[0] - losses[1]))
    return gaps, losses


def generate_body(tp, sequence_parallel):
    ps = init_tp(tp)
    model, single = twin_models(ps, tiny_config("llama", sequence_parallel))
    prompt = batch()[0][:, :3]  # 3 tokens: not a multiple of tp, the SP path pads
    greedy = model.generate(prompt, 5, temperature=0)
    assert torch.equal(greedy, single.generate(prompt, 5, temperature=0))
    torch.manual_seed(ps.tp_rank)  # different RNG on each rank: sampling must still agree
    return model.generate(prompt, 5, temperature=1.0, top_k=20)


def dropout_checkpoint_body(tp, sequence_parallel):
    """With dropout, a checkpointed model replays its masks: loss and gradients equal the
    non-checkpointed model's; the loss and the replicated parameters' gradients agree across tp."""
    ps = init_tp(tp)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(tiny_config("gpt2", sequence_parallel, dropout=0.2, activation_checkpointing=checkpointing))
        idx, targets = batch()
        loss = model(idx, targets)
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b), "checkpointed recompute drew different dropout masks"
    loss = results[0][0]
    assert_close(comm.all_reduce(loss, ps.tp_group) / tp, loss, "loss differs across tp ranks")
    norm_grad = model.final_norm.weight.grad
    assert_close(comm.all_reduce(norm_grad, ps.tp_group) / tp, norm_grad, "replicated grad differs across tp")


def bad_heads_body(tp):
    init_tp(tp)
    GPT(tiny_config("gpt2", n_head=2, n_embd=6))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gpt_matches_tp1(ranks, tp, family, sequence_parallel):
    ranks(tp).run(equal_body, tp, family, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_with_unfused_loss_matches_tp1(ranks, sequence_parallel):
    ranks(2).run(equal_body, 2, "llama", sequence_parallel, False)


@pytest.mark.parametrize("tp,family,sequence_parallel", [(2, "gpt2", False), (4, "gpt2", True),
                                                         (4, "llama", False), (2, "llama", True)])
def test_training_loss_curve_matches_tp1(ranks, tp, family, sequence_parallel):
    for gaps, losses in ranks(tp).run(curve_body, tp, family, sequence_parallel):
        assert max(gaps) < 1e-4, gaps
        assert losses[0] < 4.0  # it learned: ln(101) = 4.6 at the start


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_generate_is_identical_on_all_ranks_and_matches_tp1(ranks, sequence_parallel):
    outs = ranks(2).run(generate_body, 2, sequence_parallel)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_with_checkpointing_replays_masks_under_tp(ranks, sequence_parallel):
    ranks(2).run(dropout_checkpoint_body, 2, sequence_parallel)


def test_bad_head_count_raises_before_any_collective(ranks):
    with pytest.raises(AssertionError, match="n_head=2 is not divisible by n_kv_head|n_embd=6"):
        ranks(2).run(bad_heads_body, 2)


def test_indivisible_heads_name_the_rule():
    with pytest.raises(ValueError, match="n_head=4 is not divisible by tp=3"):
        tiny_config("gpt2").check_tp(3)


def test_presets_build_and_count_parameters():
    with torch.device("meta"):
        assert GPT(GPTConfig.preset("gpt2-small")).num_params() == 124_475_904
        assert GPT(GPTConfig.preset("llama-7b")).num_params() == 6_738_415_616
        # the published sizes of Llama 3 8B, Llama 2 13B, Code Llama 34B and Llama 3 70B
        assert GPT(GPTConfig.preset("llama-3-8b")).num_params() == 8_030_261_248
        assert GPT(GPTConfig.preset("llama-2-13b")).num_params() == 13_015_864_320
        assert GPT(GPTConfig.preset("codellama-34b")).num_params() == 33_743_970_304
        assert GPT(GPTConfig.preset("llama-3-70b")).num_params() == 70_553_706_496


def _no_group_body():
    """A GPT built with NO_GROUP under a tp=2 default state is a whole (tp=1) model in every layer."""
    from tpflash.parallel import NO_GROUP
    init_tp(2)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32), process_group=NO_GROUP)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_gpt_with_no_group_keeps_every_layer_whole_under_a_default_tp_state(ranks):
    for shapes in ranks(2).run(_no_group_body):
        assert shapes["tok_embeddings.weight"] == (64, 32)
        assert shapes["blocks.0.attn.q_proj.weight"] == (32, 32)
        assert shapes["blocks.0.mlp.up_proj.weight"] == (128, 32)
