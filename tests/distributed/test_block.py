"""ParallelTransformerBlock equals the plain pre-norm block, forward and backward, tp in {2, 4}, +/- SP;
norm-weight gradients are reduced under SP; dropout masks follow the tp layout; checkpointing
replays the same masks."""
import pytest
import torch

from tests.distributed.checks import assert_close, init_tp
from tests.models.reference import RefBlock, check_against_reference, seq_rows
from tpflash.layers import ParallelTransformerBlock, weight_casts
from tpflash.parallel import comm
from tpflash.parallel.random import RNGTracker

pytestmark = pytest.mark.cpu_ranks  # fp32 CPU references: gloo even where GPUs are visible

HIDDEN, HEADS, FFN = 32, 4, 64
GPT2 = dict(n_kv_head=4, mlp="gelu", norm="layernorm", position="learned", bias=True)
LLAMA = dict(n_kv_head=2, mlp="swiglu", norm="rmsnorm", position="rotary", bias=False)


def block_body(tp, family, sequence_parallel, checkpoint=None):
    ps = init_tp(tp)
    kw = GPT2 if family == "gpt2" else LLAMA
    torch.manual_seed(0)
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, sequence_parallel=sequence_parallel,
                                     checkpoint=checkpoint, **kw)
    ref = RefBlock(HIDDEN, HEADS, kw["n_kv_head"], FFN, kw["mlp"], kw["norm"], kw["position"] == "rotary",
                   kw["bias"])
    check_against_reference(ps, block, ref, HIDDEN, sequence_parallel)
    for name, p in block.named_parameters():  # replicated parameters must stay replicated
        if "norm" in name:
            assert_close(p.grad, comm.all_reduce(p.grad, ps.tp_group) / tp, f"{name} grad differs across tp")


def dropout_body(tp, sequence_parallel):
    """Returns this rank's block output with dropout on, for the driver to compare across ranks."""
    ps = init_tp(tp)
    torch.manual_seed(0)
    tracker = RNGTracker(seed=7, tp_rank=ps.tp_rank)
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, dropout=0.5, sequence_parallel=sequence_parallel,
                                     rng_tracker=tracker)
    torch.manual_seed(1)
    x = torch.randn(8, 2, HIDDEN)
    out, residual = block(x[seq_rows(8, ps.tp_rank, tp, sequence_parallel)])
    return (out + residual).detach()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_block_matches_reference(ranks, tp, family, sequence_parallel):
    ranks(tp).run(block_body, tp, family, sequence_parallel)


def one_all_reduce_body(tp, family):
    """Under SP a block's partial gradients (norms, row biases, replicated k/v) are summed in one
    all-reduce for the whole block (comm.tp_grad_aliases), not one per norm and bias."""
    init_tp(tp)
    kw = GPT2 if family == "gpt2" else dict(LLAMA, n_kv_head=1)  # llama: k/v replicated over tp
    torch.manual_seed(0)
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, sequence_parallel=True, **kw)
    partial = block.tp_partial_grad_parameters()
    names = {id(p): n for n, p in block.named_parameters()}
    expected = {"gpt2": ["attn_norm.weight", "attn_norm.bias", "attn.o_proj.bias", "mlp_norm.weight",
                         "mlp_norm.bias", "mlp.down_proj.bias"],
                "llama": ["attn_norm.weight", "attn.k_proj.weight", "attn.v_proj.weight", "mlp_norm.weight"]}[family]
    assert sorted(names[id(p)] for p in partial) == sorted(expected)
    x = torch.randn(8 // tp, 2, HIDDEN, requires_grad=True)
    calls, real_all_reduce = [], comm.all_reduce
    comm.all_reduce = lambda t, group: calls.append(t.numel()) or real_all_reduce(t, group)
    try:
        out, residual = block(x)
        (out + residual).sum().backward()
    finally:
        comm.all_reduce = real_all_reduce
    assert calls == [sum(p.numel() for p in partial)], f"all-reduces of {calls} elements"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_block_sums_its_partial_gradients_in_one_all_reduce(ranks, tp, family):
    ranks(tp).run(one_all_reduce_body, tp, family)


def cast_lookups_body(tp):
    """Under autocast with SP, every weight cast the block's layers ask for comes from the block's one
    multi-tensor cast (its BlockWeights' casts), the row biases' tp-gradient aliases included."""
    init_tp(tp)
    torch.manual_seed(0)
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, sequence_parallel=True, **GPT2)
    misses, real = [], weight_casts.cached_cast
    def recording(ts, dtype, casts):
        found = real(ts, dtype, casts)
        if found is None:
            misses.append([tuple(t.shape) for t in ts])
        return found
    weight_casts.cached_cast = recording
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, residual = block(torch.randn(8 // tp, 2, HIDDEN))
        (out.float() + residual.float()).sum().backward()
    finally:
        weight_casts.cached_cast = real
    assert not misses, f"casts made outside the block's one cast: {misses}"


@pytest.mark.parametrize("tp", [2, 4])
def test_a_block_under_sp_takes_every_weight_cast_from_its_one_cast(ranks, tp):
    ranks(tp).run(cast_lookups_body, tp)


@pytest.mark.parametrize("checkpoint", ["activation", "full", "mlp", "selective"])
def test_checkpointed_block_matches_reference(ranks, checkpoint):
    ranks(2).run(block_body, 2, "llama", True, checkpoint)


def test_dropout_is_identical_across_tp_without_sequence_parallel(ranks):
    outs = ranks(2).run(dropout_body, 2, False)
    assert torch.equal(outs[0], outs[1])


def test_dropout_masks_differ_across_tp_shards_under_sequence_parallel():
    a, b = RNGTracker(seed=7, tp_rank=0), RNGTracker(seed=7, tp_rank=1)
    x = torch.ones(1000)
    assert not torch.equal(a.dropout(x, 0.5, sharded=True), b.dropout(x, 0.5, sharded=True))
    assert torch.equal(a.dropout(x, 0.5, sharded=False), b.dropout(x, 0.5, sharded=False))


def test_tracker_leaves_the_default_generator_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    RNGTracker(seed=7).dropout(torch.ones(10), 0.5, sharded=True)
    assert torch.equal(torch.rand(4), expected)


def test_full_checkpointing_replays_dropout_masks():
    grads = []
    for checkpoint in (None, "full"):
        torch.manual_seed(0)
        block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, dropout=0.3, checkpoint=checkpoint,
                                         rng_tracker=RNGTracker(seed=5))
        x = torch.randn(8, 2, HIDDEN, requires_grad=True)
        out, residual = block(x)
        (out + residual).square().sum().backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _op_counts(checkpoint):
    """{op name: calls} over one forward and backward of a tp=1 Llama block with `checkpoint`."""
    from collections import Counter
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, checkpoint=checkpoint, **LLAMA)
    x = torch.randn(8, 2, HIDDEN, requires_grad=True)
    with Count() as count:
        out, residual = block(x)
        (out + residual).sum().backward()
    return count.calls


def test_selective_checkpointing_recomputes_the_norms_but_not_the_gemms():
    kept, selective, full = _op_counts(None), _op_counts("selective"), _op_counts("full")
    gemms = ("mm", "addmm", "bmm")
    assert sum(selective[g] for g in gemms) == sum(kept[g] for g in gemms) < sum(full[g] for g in gemms)
    assert selective["rsqrt"] == full["rsqrt"] > kept["rsqrt"], "the RMSNorms run again in the backward"


def test_selective_checkpointing_refuses_dropout():
    with pytest.raises(ValueError, match="checkpoint='selective' needs dropout=0, got dropout=0.1"):
        ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, checkpoint="selective", dropout=0.1, **LLAMA)


@pytest.mark.parametrize("checkpoint", [None, "activation", "full"])
def test_the_norms_write_their_outputs_where_the_projections_name_and_the_block_is_unchanged(checkpoint):
    """Where the attention and the MLP name a place for their input (input_part: the kept-input buffers of
    the overlapped path inside a graph capture, on GPUs), the norms before them write their outputs
    there, and the block computes what it computes without; not where it recomputes its forward."""
    torch.manual_seed(0)
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, checkpoint=checkpoint, **GPT2)
    x = torch.randn(8, 2, HIDDEN, requires_grad=True)
    runs, places, outputs = [], [], []
    for naming in (False, True):
        if naming:
            def named(like):
                places.append(torch.full_like(like, float("nan")))
                return places[-1]
            block.attn.input_part = block.mlp.input_part = named
        def keep_output(module, args, out):  # y, or (y, new residual)
            outputs.append((out[0] if isinstance(out, tuple) else out).detach())

        hooks = [norm.register_forward_hook(keep_output) for norm in (block.attn_norm, block.mlp_norm)]
        outputs.clear()
        out, residual = block(x)
        (out + residual).square().sum().backward()
        runs.append(((out + residual).detach(), x.grad.clone()))
        x.grad = None
        for hook in hooks:
            hook.remove()
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1]), "the block changed"
    if checkpoint == "full":
        assert not places, "a block that recomputes its forward named places for its norms"
    else:
        assert len(places) == 2 and all(torch.equal(p, o) for p, o in zip(places, outputs[:2]))


def test_a_block_refuses_parts_without_a_residual():
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, **GPT2)
    x = torch.randn(8, 2, HIDDEN)
    with pytest.raises(ValueError, match="x is a tuple of 2 parts but residual is None"):
        block((x, x))


def grad_ports_body(tp):
    """take_input_grad_parts gives the norms tp - 1 gradient ports only where their kernels can add the
    column layers' parts: no recomputation of the forward and no fp8 GEMMs (the fused dense MLP and
    more than four ranks, also refused, need a GPU and eight ranks); taken back, none."""
    init_tp(tp)

    def ports(**kw):
        block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=FFN, sequence_parallel=True, **{**GPT2, **kw})
        block.take_input_grad_parts(True)
        taken = (block.attn_norm.grad_ports, block.mlp_norm.grad_ports)
        block.take_input_grad_parts(False)
        assert (block.attn_norm.grad_ports, block.mlp_norm.grad_ports) == (0, 0)
        return taken
    assert ports() == (tp - 1, tp - 1)
    assert ports(checkpoint="activation") == (tp - 1, tp - 1)
    for checkpoint in ("full", "mlp", "selective"):
        assert ports(checkpoint=checkpoint) == (0, 0), checkpoint
    assert ports(fp8="rowwise") == (0, 0)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_block_gives_its_norms_gradient_ports_only_where_they_can_add_the_parts(ranks, tp):
    ranks(tp).run(grad_ports_body, tp)


def row_grads_body(tp):
    """norms_write_row_grads has mlp_norm (and, after a block, attn_norm) write its input's gradient where
    the row layer before it gathers it, only under sequence parallelism with nothing recomputed and
    no fp8 GEMMs; taken back, nowhere. A block after a block that recomputes its forward, or whose
    MLP gathers nothing, leaves attn_norm's alone (`output_grad_gathered_in_place`)."""
    init_tp(tp)
    sp_block = lambda **kw: ParallelTransformerBlock(  # noqa: E731
        HIDDEN, HEADS, **{"ffn_hidden": FFN, "sequence_parallel": True, **GPT2, **kw})

    def writers(previous="block", **kw):
        block = sp_block(**kw)
        block.norms_write_row_grads(True, sp_block() if previous == "block" else previous)
        given = (block.attn_norm.x_grad_into is not None, block.mlp_norm.x_grad_into is not None)
        block.norms_write_row_grads(False)
        assert (block.attn_norm.x_grad_into, block.mlp_norm.x_grad_into) == (None, None)
        return given
    assert writers() == (True, True)
    assert writers(previous=None) == (False, True)
    assert writers(previous=sp_block(checkpoint="full")) == (False, True)
    assert writers(checkpoint="activation") == (True, True)
    for checkpoint in ("full", "mlp", "selective"):
        assert writers(checkpoint=checkpoint) == (False, False), checkpoint
    assert writers(fp8="rowwise") == (False, False)
    assert writers(sequence_parallel=False) == (False, False)
    gathered = lambda **kw: sp_block(**kw).output_grad_gathered_in_place  # noqa: E731
    assert gathered() and gathered(checkpoint="activation")
    assert not gathered(checkpoint="full") and not gathered(fp8="rowwise")
    # a down projection that keeps its gathered grad_y for a held weight gradient has it written into that buffer
    # (where weight gradients are held: no gradient hooks)
    assert not sp_block(ffn_hidden=2 * HIDDEN * tp).output_grad_into(holding=True).keywords["kept"]
    paired = sp_block(ffn_hidden=HIDDEN * tp)
    assert paired.output_grad_into(holding=True).keywords["kept"]
    assert not paired.output_grad_into(holding=False).keywords["kept"]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_blocks_norms_write_the_row_layers_output_gradients_only_where_their_gathers_come_next(ranks, tp):
    ranks(tp).run(row_grads_body, tp)


@pytest.mark.parametrize("ffn,family,fp8,pairs", [(HIDDEN, "gpt2", "off", True), (FFN, "gpt2", "off", False),
                                                  (HIDDEN, "llama", "off", False), (HIDDEN, "gpt2", "rowwise", False)],
                         ids=["same-shape", "4x-at-tp1", "swiglu", "fp8"])
def test_a_block_holds_its_down_projections_weight_gradient_only_where_it_batches_with_the_ups(ffn, family, fp8,
                                                                                                 pairs):
    """The down projection's weight gradient is held for the output projection's backward (to run in one
    batched GEMM with the up projection's) only where the two have one shape, without a gate or fp8."""
    block = ParallelTransformerBlock(HIDDEN, HEADS, ffn_hidden=ffn, fp8=fp8, **(GPT2 if family == "gpt2" else LLAMA))
    assert block.mlp.pairs_weight_grads() is pairs
    assert block.mlp.down_proj.weight_grad_held_for is (block.held_work if pairs else None)
