"""parallelize(module, plan) turns a user's own transformer (nn.Linear / nn.Embedding, widths that tp does
not divide) into a tensor-parallel one that computes exactly what the original computes, tp in {2, 4}."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tpflash
from tests.distributed.checks import assert_close, init_tp
from tpflash.losses.cross_entropy import vocab_parallel_cross_entropy
from tpflash.parallel import comm, full_state_dict, parallelize
from tpflash.parallel.sharding import iter_sharded

pytestmark = pytest.mark.cpu_ranks  # fp32 references on CPU: gloo even where GPUs are visible

VOCAB, DIM, HEAD_DIM, FFN, POSITIONS = 301, 24, 6, 75, 16  # 301 and 75 divide by neither 2 nor 4
BATCH, SEQ = 2, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        self.k = nn.Linear(DIM, DIM, bias=False)  # a key bias shifts each score row: its gradient is 0

    def forward(self, x):  # [b, s, DIM]
        b, s, _ = x.shape

        def heads(t):  # [b, s, width] -> [b, heads, s, HEAD_DIM]: under tp, width holds this rank's heads
            return t.view(b, s, -1, HEAD_DIM).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x):
        return self.down(torch.sigmoid(self.up(x)))  # sigmoid(0) = 0.5: padding features are not zero here


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, n_blocks=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(POSITIONS, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids):  # [b, s] -> logits [b, s, VOCAB] (or this rank's vocabulary shard)
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def plan(gather_logits: bool):
    return {"tok": "vocab", "pos": "colwise",
            "blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.o": "rowwise",
            "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
            "head": {"style": "colwise", "gather_output": gather_logits}}


def build(seed):
    torch.manual_seed(seed)
    return TinyLM()


def batch(step=0):
    g = torch.Generator().manual_seed(100 + step)  # same tokens on every rank
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, ids, targets, gather_logits, ps=None):
    logits = model(ids)
    if gather_logits or ps is None:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    return vocab_parallel_cross_entropy(logits, targets, ps.tp_group, vocab_size=VOCAB)


def full_grads(model):
    """Every parameter's gradient at its unsharded, unpadded shape."""
    sharded = {key: (spec, group) for key, spec, group in iter_sharded(model)}
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if name in sharded:
            spec, group = sharded[name]
            g = spec.unpad(comm.all_gather(g, spec.dim, group))
        out[name] = g
    return out


def padding(model, grads=False):
    """{name: the padding part of this rank's shard} (of the gradients with grads=True); empty where none."""
    params = dict(model.named_parameters())
    out = {}
    for name, spec, group in iter_sharded(model):
        start, end = spec.local_range(group.rank(), group.size())
        t = params[name].grad if grads else params[name].detach()
        out[name] = t.narrow(spec.dim, end - start, t.shape[spec.dim] - (end - start))
    return out


def assert_padding_zero(model, grads=False):
    for name, pad in padding(model, grads).items():
        assert pad.numel() == 0 or torch.count_nonzero(pad) == 0, f"padding of {name} is not zero (grads={grads})"


def equivalence_body(tp, gather_logits):
    ps = init_tp(tp)
    ref = build(seed=0)
    model = parallelize(copy.deepcopy(ref), plan(gather_logits), ps)
    ids, targets = batch()
    logits, ref_logits = model(ids), ref(ids)
    if not gather_logits:  # this rank's (padded) vocabulary shard
        logits = comm.all_gather(logits.detach(), -1, ps.tp_group)[..., :VOCAB]  # the padding is at the end
    assert_close(logits, ref_logits, "logits")
    loss_of(model, ids, targets, gather_logits, ps).backward()
    loss_of(ref, ids, targets, gather_logits).backward()
    grads = full_grads(model)
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, f"grad of {name}")
    assert_padding_zero(model, grads=True)


def moved_weights_body(tp):
    ps = init_tp(tp)
    model = build(seed=0)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    parallelize(model, plan(True), ps)
    assert torch.equal(torch.get_rng_state(), rng), "parallelize drew random numbers"
    full = full_state_dict(model)
    assert full.keys() == original.keys()
    for key, value in original.items():
        assert full[key].shape == value.shape and torch.equal(full[key], value), f"{key} differs from the original"
    c = -(-FFN // tp)
    assert model.blocks[0].mlp.up.weight.shape == (c, DIM) and model.blocks[0].mlp.down.weight.shape == (DIM, c)
    assert_padding_zero(model)


def training_body(tp):
    """AdamW with weight decay: padding gradients are exactly zero, padding weights stay exactly zero,
    and the trained weights equal the original model's trained the same way."""
    ps = init_tp(tp)
    ref = build(seed=0)
    model = parallelize(copy.deepcopy(ref), plan(False), ps)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref)]
    for step in range(3):
        ids, targets = batch(step)
        loss_of(model, ids, targets, False, ps).backward()
        loss_of(ref, ids, targets, False).backward()
        assert_padding_zero(model, grads=True)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_padding_zero(model)
    full = full_state_dict(model)
    for key, value in ref.state_dict().items():
        assert_close(full[key], value, key)


def save_body(root):
    """At tp=2: one AdamW step, then save; return the full state and the logits for batch 1."""
    ps = init_tp(2)
    model = parallelize(build(seed=0), plan(True), ps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, targets = batch(0)
    loss_of(model, ids, targets, True).backward()
    opt.step()
    tpflash.checkpoint.save(root, model, opt, step=1)
    with torch.no_grad():
        logits = model(batch(1)[0])
    return full_state_dict(model), logits


def load_body(root, tp, saved, saved_logits):
    ps = init_tp(tp)
    model = parallelize(build(seed=1), plan(True), ps)  # other weights: the load must replace all of them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert tpflash.checkpoint.load(root, model, opt)["step"] == 1
    full = full_state_dict(model)
    assert full.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(full[key], value), f"{key} differs after loading at tp={tp}"
    assert_padding_zero(model)
    with torch.no_grad():
        assert_close(model(batch(1)[0]), saved_logits, "logits after the resharded load")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gather_logits", [True, False], ids=["gathered_logits", "vocab_parallel_loss"])
def test_parallelized_user_transformer_matches_original_forward_and_gradients(ranks, tp, gather_logits):
    ranks(tp).run(equivalence_body, tp, gather_logits)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallelize_moves_weights_without_reinitialising(ranks, tp):
    ranks(tp).run(moved_weights_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_padding_stays_zero_through_training_and_training_matches_original(ranks, tp):
    ranks(tp).run(training_body, tp)


def test_uneven_checkpoint_saved_at_tp2_loads_at_tp4_with_same_output(ranks, tmp_path):
    root = str(tmp_path / "run")
    saved, logits = ranks(2).run(save_body, root)[0]
    ranks(4).run(load_body, root, 4, saved, logits)


def padded_pair_body(tp, width, layout):
    """Linear(DIM, width) -> sigmoid -> Linear(width, DIM) with tp not dividing width: "parallel" (column
    output stays sharded), "gathered" (gather_output=True, then input_is_parallel=False), or
    "sequence_parallel" ([seq/tp, b, DIM] in and out), "overlap" (sequence_parallel, collectives pipelined
    with the GEMMs)."""
    ps = init_tp(tp)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(DIM, width), nn.Sigmoid(), nn.Linear(width, DIM))
    sp, overlap = layout in ("sequence_parallel", "overlap"), layout == "overlap"
    col = {"style": "colwise", "sequence_parallel": sp, "overlap": overlap, "gather_output": layout == "gathered"}
    row = {"style": "rowwise", "sequence_parallel": sp, "overlap": overlap, "input_is_parallel": layout != "gathered"}
    model = parallelize(copy.deepcopy(ref), {"0": col, "2": row}, ps)
    torch.manual_seed(1)
    x, grad = torch.randn(SEQ, BATCH, DIM), torch.randn(SEQ, BATCH, DIM)
    rows = slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp) if sp else slice(None)
    x_local, x_ref = x[rows].clone().requires_grad_(), x.clone().requires_grad_()
    hidden = model[0](x_local)
    real = model[0].local_real
    assert hidden.shape[-1] == (width if layout == "gathered" else -(-width // tp))
    if layout != "gathered":
        assert torch.count_nonzero(hidden[..., real:]) == 0, "padding outputs of the column layer are not zero"
    y, y_ref = model[2](model[1](hidden)), ref(x_ref)
    assert_close(y, y_ref[rows], "output")
    (y * grad[rows]).sum().backward()
    (y_ref * grad).sum().backward()
    assert_close(x_local.grad, x_ref.grad[rows], "input grad")
    grads = full_grads(model)
    for name, p in ref.named_parameters():
        assert_close(grads[name], p.grad, f"grad of {name}")
    assert_padding_zero(model, grads=True)


def column_embedding_body(tp, sequence_parallel):
    ps = init_tp(tp)
    torch.manual_seed(0)
    ref = nn.Embedding(13, 7, padding_idx=2)  # 7 features: padded at tp 2 and 4
    model = parallelize(nn.Sequential(copy.deepcopy(ref)), {"0": {"style": "colwise",
                                                                 "sequence_parallel": sequence_parallel}}, ps)
    ids = torch.randint(0, 13, (SEQ, BATCH), generator=torch.Generator().manual_seed(3))
    ids[0, 0] = 2
    grad = torch.randn(SEQ, BATCH, 7, generator=torch.Generator().manual_seed(4))
    rows = slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp) if sequence_parallel else slice(None)
    out, out_ref = model(ids), ref(ids)
    assert_close(out, out_ref[rows], "output")
    (out * grad[rows]).sum().backward()
    (out_ref * grad).sum().backward()
    assert_close(full_grads(model)["0.weight"], ref.weight.grad, "weight grad")
    assert_padding_zero(model, grads=True)


@pytest.mark.parametrize("tp,width", [(2, 75), (4, 75), (4, 5)])  # 5 at tp=4: ranks hold 2, 2, 1, 0 real
@pytest.mark.parametrize("layout", ["parallel", "gathered", "sequence_parallel", "overlap"])
def test_padded_column_sigmoid_row_pair_equals_the_two_linears(ranks, tp, width, layout):
    ranks(tp).run(padded_pair_body, tp, width, layout)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_colwise_embedding_with_padded_features_matches_nn_embedding(ranks, tp, sequence_parallel):
    ranks(tp).run(column_embedding_body, tp, sequence_parallel)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = self.a


BAD_PLANS = {  # case: (model, plan, the rule the message names)
    "matches_nothing": (TinyLM, {"blocks.*.attn.qq": "colwise"}, r"'blocks\.\*\.attn\.qq': matches no submodule"),
    "vocab_on_linear": (TinyLM, {"head": "vocab"}, r"'head': style 'vocab' applies to nn\.Embedding, but 'head' is Linear"),
    "rowwise_on_embedding": (TinyLM, {"tok": "rowwise"}, r"'tok': style 'rowwise' applies to nn\.Linear, but 'tok'"),
    "not_linear_or_embedding": (TinyLM, {"blocks.*.ln1": "colwise"}, r"'blocks\.0\.ln1' is LayerNorm"),
    "unknown_style": (TinyLM, {"head": "diagonal"}, r"'head': unknown style 'diagonal'"),
    "unknown_option": (TinyLM, {"head": {"style": "rowwise", "gather_output": True}},
                       r"options \['gather_output'\] do not apply to style 'rowwise'"),
    "no_style": (TinyLM, {"head": {"gather_output": True}}, r"'head': the value must be a style name or a dict"),
    "matched_twice": (TinyLM, {"blocks.*.mlp.up": "colwise", "blocks.0.mlp.*": "colwise"},
                      r"'blocks\.0\.mlp\.\*': 'blocks\.0\.mlp\.up' is also matched by plan entry 'blocks\.\*\.mlp\.up'"),
    "sp_row_needs_parallel_input": (TinyLM, {"head": {"style": "rowwise", "sequence_parallel": True,
                                                      "input_is_parallel": False}},
                                    r"sequence_parallel=True needs input_is_parallel=True"),
    "tied_weights": (Tied, {"head": {"style": "colwise"}}, r"'head': head\.weight is tied to \['emb\.weight'\]"),
    "shared_module": (Shared, {"a": "colwise"}, r"'a': 'a' is the same module as \['b'\]"),
}


def bad_plan_body(case):
    import re
    ps = init_tp(2)
    make, bad, rule = BAD_PLANS[case]
    torch.manual_seed(0)
    model = make()
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=rule) as info:
        parallelize(model, bad, ps)
    assert re.search(r"^parallelize: plan entry ", str(info.value))
    assert [type(m) for m in model.modules()] == before, "a failed parallelize changed the module"
    dist.barrier(ps.tp_group)  # no rank is left inside a collective
    return str(info.value)


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_raises_the_same_value_error_on_every_rank(ranks, case):
    messages = ranks(2).run(bad_plan_body, case)
    assert len(set(messages)) == 1, messages


def test_parallelize_without_a_process_group_keeps_the_parameters():
    tpflash.parallel.set_default_state(None)
    model = build(seed=0)
    ids = batch()[0]
    expected, params = model(ids), dict(model.named_parameters())
    parallelize(model, plan(True))
    assert all(p is params[n] for n, p in model.named_parameters()), "tp=1 must keep the same nn.Parameters"
    assert torch.equal(model(ids), expected)
