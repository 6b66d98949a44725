"""A GPT whose blocks replay captured graphs (GPT.capture_cuda_graphs) trains exactly like the same
GPT run eagerly: losses and gradients over AdamW steps, with and without sequence parallelism, at
tp 2 and 4, gradient accumulation included. On CPU the graphs are the eager stand-in (every line
of the replay plumbing runs under gloo); the gpu tests capture real CUDA graphs (NCCL inside)."""

import pytest
import torch

from tests.distributed.checks import assert_close, environment, init_tp
from tests.models.reference import assert_grad_close
from tpflash.models import GPT, GPTConfig
from tpflash.parallel import comm, overlap, overlap_gemms, overlap_transfers, peer_collectives

VOCAB, SEQ, BATCH = 101, 8, 2


def config(sequence_parallel, **kw):
    return GPTConfig.preset("gpt2-tiny", vocab_size=VOCAB, block_size=16, n_layer=3, n_embd=32, n_head=4,
                            ffn_hidden=64, sequence_parallel=sequence_parallel, **kw)


def twins(cfg, device):
    """(graphed model, eager model), the same weights."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(cfg, device=device))
    return models


def batch(seed, device, batch_size=BATCH):
    g = torch.Generator().manual_seed(seed)  # the same tokens on every rank
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx.to(device), torch.randint(0, VOCAB, (batch_size, SEQ), generator=g).to(device)


def amp(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_body(tp, sequence_parallel, steps=3, micro_batches=2, overlap_on=False, comm_backend="auto",
               checkpointing=False, overlap_eager=False, accumulate_grads=False):
    """`steps` AdamW steps of `micro_batches` accumulated backwards each: graphed vs eager (the graphed
    one's collectives overlapping the GEMMs when `overlap_on`; serial ones by `comm_backend`;
    overlap_on=None: the library's default, decided at capture; the eager one's overlapping with
    `overlap_eager`, else serial; `checkpointing`: both models' activation_checkpointing,
    recomputed inside the backward graph for the graphed one; `accumulate_grads`: the graphed one's
    weight-gradient GEMMs adding into its weights' main_grad, which must be their .grad)."""
    device = init_tp(tp).device if tp > 1 else torch.device("cuda")
    graphed, eager = twins(config(sequence_parallel, activation_checkpointing=checkpointing), device)
    calls = []  # all-gathers through the copy engines (tpflash.parallel.peer_collectives)
    kept = []  # for each gather into a layer's kept buffer: (its owner, whether this rank's rows were there already)
    in_slot = []  # for each other gather of its parts as one tensor: whether this rank's rows lay in its slot
    real, real_kept_buffer, owners = peer_collectives.PeerAllGather, peer_collectives.kept_buffer, {}

    class Counted(real):
        def __init__(self, *args, **kwargs):
            calls.append(1)
            super().__init__(*args, **kwargs)
            if self.kept is not None:
                kept.append((owners[id(self.kept)], self.own_copied is None))
            elif self.adjacent and peer_collectives.capturing_for_graphs():  # the warm-up's and capture's
                in_slot.append(self.own_copied is None)

    def kept_buffer(owner, *args):
        buffer = real_kept_buffer(owner, *args)
        owners[id(buffer)] = owner
        return buffer

    parted = []  # how many parts each copy-engine reduce-scatter left unsummed for the next norm
    real_parts = peer_collectives.PeerReduceScatter.finish_parts

    def finish_parts(self, own):
        parts = real_parts(self, own)
        parted.append(len(parts))
        return parts

    peer_collectives.PeerAllGather, peer_collectives.kept_buffer = Counted, kept_buffer
    peer_collectives.PeerReduceScatter.finish_parts = finish_parts
    try:
        overlap.set_overlap(graphed, overlap_on)  # None: the capture decides
        overlap.set_overlap(eager, True if overlap_eager else None)
        # above two ranks the overlapped layers add the ranks' parts in another order than the eager
        # twin's serial ones: fp32 sums then differ in the last bits
        cpu_tol = 1e-5 if overlap_on and tp > 2 else 1e-6
        with environment(TPFLASH_COMM_BACKEND=comm_backend):
            _train(graphed, eager, device, steps, micro_batches, cpu_tol, accumulate_grads)
    finally:
        peer_collectives.PeerAllGather, peer_collectives.kept_buffer = real, real_kept_buffer
        peer_collectives.PeerReduceScatter.finish_parts = real_parts
    if device.type == "cuda" and tp > 1 and sequence_parallel and graphed._graphed_blocks.overlapped:
        # inside the capture the row layers' parts go to the next norm unsummed (where no block
        # recomputes its forward), and only there; so do the q/k/v and up projections' input
        # gradients' parts, to the norms before them (take_input_grad_parts, on the same condition here)
        handing = all(b.norm_sums_parts for b in graphed.blocks)
        in_place = all(b.norms_write_in_place for b in graphed.blocks)
        layers = len(graphed.blocks)
        unsummed = (2 * layers - 1 if handing else 0) + (2 * layers if in_place and tp <= 4 else 0)
        assert parted.count(tp) == unsummed, f"the captured reduce-scatters handed {parted} parts, not {unsummed} x {tp}"
        # and the norms write their outputs where the q/k/v and up projections keep their gathered inputs
        pairing = any(b.mlp.down_proj.weight_grad_held_for for b in graphed.blocks)
        downs = {id(overlap_transfers.held_grad_y_owner(b.mlp.down_proj.process_group)) for b in graphed.blocks} \
            if pairing else set()
        inputs = [found for owner, found in kept if id(owner) not in downs]
        assert inputs and all(inputs) == in_place, f"the kept gathers found this rank's rows in place: {inputs}"
        # and, in the backward, their input's gradient where the row layers before them gather it (into the
        # down projections' kept buffers where they hold their weight gradients): every row layer's but
        # the last block's down projection's, whose gradient comes from outside the stack
        grads = [found for owner, found in kept if id(owner) in downs]
        backwards = in_slot.count(False) + grads.count(False)
        placed = (2 * layers - 1) * backwards if in_place else 0
        assert in_slot.count(True) + grads.count(True) == placed, \
            f"the row layers' backward gathers found grad_y in place: {in_slot}, kept: {grads}"
        if downs and in_place:
            assert len(grads) == layers * backwards, f"{len(grads)} gathers of grad_y kept in {backwards} backwards"
    if device.type == "cuda" and tp > 1 and sequence_parallel and comm_backend != "nccl":
        # captured collectives, serial or overlapped, go through the copy engines on GPUs with peer
        # access (test machines)
        assert calls, f"TPFLASH_COMM_BACKEND={comm_backend}: the captured all-gathers did not use the copy engines"
        if overlap_on is None:
            assert graphed._graphed_blocks.overlapped, "the default capture did not overlap on GPUs with peer access"
    if comm_backend == "nccl":
        assert not calls, "TPFLASH_COMM_BACKEND=nccl used the copy engines"
    if overlap_on is not None and tp > 1:
        assert graphed._graphed_blocks.overlapped is overlap_on, "the capture did not keep the setting"


def _train(graphed, eager, device, steps, micro_batches, cpu_tol=1e-6, accumulate_grads=False):
    with amp(device):
        graphed.capture_cuda_graphs(BATCH, SEQ, accumulate_grads=accumulate_grads)
    main = graphed._graphed_blocks.main_grads
    assert (main is not None) == accumulate_grads, "main_grad buffers were not made as asked"
    if accumulate_grads:  # every linear weight of the blocks: q/k/v, o, up, down
        assert len(main.weights) == 6 * len(graphed.blocks), f"{len(main.weights)} weights add into main_grad"
    # accumulating, the fused AdamW the trainer uses: it updates in place without moving version counters
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, fused=accumulate_grads or None) for m in (graphed, eager)]
    tol = 2e-2 if device.type == "cuda" else cpu_tol
    for step in range(steps):
        losses = []
        for model, opt in zip((graphed, eager), opts):
            total = 0.0
            for mb in range(micro_batches):
                idx, targets = batch(10 * step + mb, device)
                with amp(device):
                    loss = model(idx, targets)
                loss.backward()
                total += loss.detach()
            losses.append(total)
            if model is graphed:
                grads = [p.grad.clone() for p in model.parameters()]
                if accumulate_grads:
                    assert all(w.grad is b for w, b in zip(main.weights, main.buffers)), ".grad is not main_grad"
            else:
                for (name, p), g in zip(model.named_parameters(), grads):
                    assert_grad_close(g, p.grad, f"step {step}: grad of {name}", tol=tol)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert_close(losses[0], losses[1], f"step {step}: loss", tol=tol)
    assert graphed._graphed_blocks.forward_generation == steps * micro_batches, "the replays did not run"


def fallback_body(tp):
    """Calls the capture does not cover run the blocks eagerly and give the eager model's results."""
    ps = init_tp(tp)
    graphed, eager = twins(config(True), ps.device)
    graphed.capture_cuda_graphs(BATCH, SEQ)
    idx, targets = batch(5, ps.device, batch_size=BATCH + 1)  # another batch size
    assert_close(graphed(idx, targets), eager(idx, targets), "loss at another shape", tol=1e-6)
    with torch.no_grad():
        idx, targets = batch(6, ps.device)
        assert not graphed._graphed_blocks.matches(graphed.embed(idx))
        assert_close(graphed(idx, targets), eager(idx, targets), "loss under no_grad", tol=1e-6)


def casts_in_waits_body(tp, checkpointing=None):
    """Under bf16 autocast with the overlap on, the graphed stack casts the first block's weights before
    it and each next block's inside the previous block's output projection (beside its reduce-scatter's
    last transfers), and gives the eager model's loss and gradients bit for bit (with `checkpointing`
    too: the recomputed blocks cast their own)."""
    from tpflash.layers import weight_casts
    ps = init_tp(tp)
    graphed, eager = twins(config(True, activation_checkpointing=checkpointing), ps.device)
    for model in (graphed, eager):
        overlap.set_overlap(model, True)
    inside, fills = [False], []
    real_scatter, real_fill = overlap_gemms._multiply_scatter, weight_casts.PendingCast.fill

    def scatter(*args, **kwargs):
        inside[0] = True
        try:
            return real_scatter(*args, **kwargs)
        finally:
            inside[0] = False

    def fill(cast):
        if not cast.filled:
            fills.append(inside[0])
        real_fill(cast)

    overlap_gemms._multiply_scatter, weight_casts.PendingCast.fill = scatter, fill
    results = []
    try:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        with autocast:
            graphed.capture_cuda_graphs(BATCH, SEQ)
        for model in (graphed, eager):
            fills.clear()
            with autocast:
                loss = model(*batch(3, ps.device))
            if model is graphed:  # the forward's casts (recomputed blocks cast their own in the backward)
                n = config(True).n_layer
                assert fills == [False] + [True] * (n - 1), f"casts issued inside an output projection: {fills}"
            loss.backward()
            results.append([loss] + [p.grad for p in model.parameters()])
    finally:
        overlap_gemms._multiply_scatter, weight_casts.PendingCast.fill = real_scatter, real_fill
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"graphed and eager differ ({'loss' if i == 0 else f'gradient {i - 1}'})"


def hooked_body(tp):
    """A capture holds weight-gradient GEMMs back only where no parameter has a gradient hook (a hook
    would read the held gradient before the GEMM fills it)."""
    ps = init_tp(tp)
    plain, hooked = twins(config(True), ps.device)
    hooked.blocks[1].mlp.up_proj.weight.register_hook(lambda g: g)
    for model in (plain, hooked):
        model.capture_cuda_graphs(BATCH, SEQ)
    assert len(plain._graphed_blocks.held) == config(True).n_layer, "a capture without hooks holds nothing back"
    assert hooked._graphed_blocks.held == [], "a capture held gradients back although a parameter has a hook"


def out_of_order_body(tp):
    ps = init_tp(tp)
    model = twins(config(True), ps.device)[0]
    model.capture_cuda_graphs(BATCH, SEQ)
    first = model(*batch(1, ps.device))
    model(*batch(2, ps.device))  # overwrites the activations `first` would need
    try:
        first.backward()
    except RuntimeError as e:
        assert "out of order" in str(e), e
    else:
        raise AssertionError("a stale backward through the graphed blocks did not raise")


def one_all_reduce_body(tp):
    """The graphed stack's backward sums every block's partial gradients in ONE all-reduce (one
    set of tp-gradient aliases for the stack: comm.tp_grad_aliases) instead of one per block."""
    ps = init_tp(tp)
    model = twins(config(True), ps.device)[0]
    model.capture_cuda_graphs(BATCH, SEQ)
    given = [(b.block_weights.casts, b.block_weights.aliases) for b in model.blocks]
    assert given == [(None, None)] * len(model.blocks), "the stack's casts and aliases outlived the capture"
    partial = [p for block in model.blocks for p in block.tp_partial_grad_parameters()]
    x = model.embed(batch(1, ps.device)[0]).detach().requires_grad_(True)
    calls, real_all_reduce = [], comm.all_reduce
    comm.all_reduce = lambda t, group: calls.append(t.numel()) or real_all_reduce(t, group)
    try:
        out, residual = model._graphed_blocks(x)
        (out + residual).sum().backward()
    finally:
        comm.all_reduce = real_all_reduce
    assert calls == [sum(p.numel() for p in partial)], f"all-reduces of {calls} elements"
    assert all(p.grad is not None for p in partial)


@pytest.mark.cpu_ranks
def test_the_graphed_stack_sums_all_partial_gradients_in_one_all_reduce(ranks):
    ranks(2).run(one_all_reduce_body, 2)


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_graphed_gpt_trains_like_the_eager_gpt(ranks, tp, sequence_parallel):
    ranks(tp).run(train_body, tp, sequence_parallel)


@pytest.mark.cpu_ranks
def test_graphed_gpt_with_overlap_trains_like_the_eager_gpt(ranks):
    ranks(2).run(train_body, 2, True, 2, 2, True)


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("tp,overlap_on", [(2, False), (2, True), (4, True)])
def test_graphed_gpt_adding_weight_gradients_in_the_gemms_trains_like_the_eager_gpt(ranks, tp, overlap_on):
    # the eager twin overlaps too where the graphed one does: the same sums in the same order
    ranks(tp).run(train_body, tp, True, 3, 3, overlap_on, "auto", False, overlap_on, True)


def test_graphed_gpt_adding_weight_gradients_in_the_gemms_on_one_rank_trains_like_the_eager_gpt():
    graphed, eager = twins(config(False), torch.device("cpu"))
    _train(graphed, eager, torch.device("cpu"), 2, 2, accumulate_grads=True)


@pytest.mark.cpu_ranks
def test_graphed_gpt_holds_weight_gradients_for_the_output_projection_and_trains_like_the_eager_gpt(ranks):
    ranks(4).run(overlap_held_body, 4)


@pytest.mark.cpu_ranks
def test_graphed_gpt_batches_same_shape_mlp_weight_gradients_and_trains_like_the_eager_gpt(ranks):
    ranks(2).run(paired_held_body, 2)


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("checkpointing", [None, "full"])
def test_the_graphed_stack_casts_each_next_blocks_weights_in_the_output_projections_wait(ranks, checkpointing):
    ranks(2).run(casts_in_waits_body, 2, checkpointing)


@pytest.mark.cpu_ranks
def test_a_gradient_hook_on_any_parameter_turns_holding_off(ranks):
    ranks(2).run(hooked_body, 2)


@pytest.mark.cpu_ranks
def test_graphed_gpt_runs_other_shapes_and_no_grad_eagerly(ranks):
    ranks(2).run(fallback_body, 2)


@pytest.mark.cpu_ranks
def test_backward_of_a_replaced_forward_raises(ranks):
    ranks(2).run(out_of_order_body, 2)


@pytest.mark.cpu_ranks
@pytest.mark.parametrize("checkpointing", ["activation", "full", "mlp", "selective"])
def test_graphed_gpt_with_activation_checkpointing_trains_like_the_eager_gpt(ranks, checkpointing):
    ranks(2).run(train_body, 2, True, 3, 2, False, "auto", checkpointing)


@pytest.mark.parametrize("setting,match", [(dict(dropout=0.1), "dropout=0.1")])
def test_capture_rejects_what_a_replay_would_get_wrong(setting, match):
    model = GPT(config(False, **setting))
    with pytest.raises(ValueError, match=match):
        model.capture_cuda_graphs(BATCH, SEQ)


def test_a_forward_replay_first_moves_accumulating_gradients_out_of_the_graph_buffers():
    # autograd keeps the graph's gradient buffer itself as .grad; a forward replay may overwrite
    # that memory on a GPU, so under accumulation the .grad must be copied out before it
    model = GPT(config(False))
    model.capture_cuda_graphs(BATCH, SEQ)
    graphed = model._graphed_blocks
    model(*batch(1, torch.device("cpu"))).backward()
    buffers = {g.data_ptr() for g in graphed.input_grads[1:] if g is not None}
    aliased = [p for p in graphed.params if p.grad.data_ptr() in buffers]
    assert aliased, "no .grad aliases a graph buffer: this test would not cover the copy"
    before = [p.grad.clone() for p in aliased]
    model(*batch(2, torch.device("cpu")))
    for p, value in zip(aliased, before):
        assert p.grad.data_ptr() not in buffers and torch.equal(p.grad, value)


class _NotPlain(torch.Tensor):
    """Stands in for a DTensor/FSDP parameter: anything but a plain tensor."""


@pytest.mark.parametrize("fp8", ["off", "tensorwise"])
def test_graphed_blocks_under_autocast_give_the_eager_gradients_bit_for_bit(fp8):
    """The backward is captured outside autocast, as autograd runs it eagerly: under bf16 autocast a
    replay's gradients are the eager model's bits (captured under autocast, the CPU stand-in's
    fp32 GEMMs in the backward, e.g. fp32 weight gradients, ran in bf16)."""
    def loss_and_grads(graphed):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("llama-tiny", vocab_size=VOCAB, block_size=16, n_layer=2, n_embd=32, n_head=4,
                                     n_kv_head=2, ffn_hidden=64, fp8=fp8))
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        if graphed:
            with autocast:
                model.capture_cuda_graphs(BATCH, SEQ)
        idx, targets = batch(0, "cpu")
        with autocast:
            loss = model(idx, targets)
        loss.backward()
        assert (model._graphed_blocks is not None) == graphed
        return [loss] + [p.grad for p in model.parameters()]
    for eager, graphed in zip(loss_and_grads(False), loss_and_grads(True)):
        assert torch.equal(eager, graphed)


def test_accumulating_graphed_blocks_cast_the_weights_once_per_step_and_match_eager_bit_for_bit():
    """With accumulate_grads under bf16 autocast, two fused AdamW steps (which update the weights in place
    without moving their version counters) of two micro-batches each: the weights
    are cast once per change (at capture, then before the first forward replay after the step;
    never inside a micro-batch's graph), the
    weight gradients are added into main_grad by the GEMMs, and loss and gradients are the eager
    model's bits."""
    from tpflash.layers import weight_casts
    fills, real_fill = [], weight_casts.PendingCast.fill
    weight_casts.PendingCast.fill = lambda cast, again=False: fills.append(again) or real_fill(cast, again)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    results = []
    try:
        for graphed in (False, True):
            torch.manual_seed(0)
            model = GPT(GPTConfig.preset("llama-tiny", vocab_size=VOCAB, block_size=16, n_layer=2, n_embd=32,
                                         n_head=4, n_kv_head=2, ffn_hidden=64))
            opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
            if graphed:
                with autocast:
                    model.capture_cuda_graphs(BATCH, SEQ, accumulate_grads=True)
            run = []
            for step in range(2):
                fills.clear()
                for mb in range(2):
                    with autocast:
                        loss = model(*batch(10 * step + mb, "cpu"))
                    loss.backward()
                    run.append(loss.detach())
                if graphed:  # the capture cast the first step's weights; the AdamW step changed them
                    expected = [] if step == 0 else [True] * len(model.blocks)
                    assert fills == expected, f"casts issued in step {step}: {fills}"
                run += [p.grad.clone() for p in model.parameters()]
                opt.step()
                opt.zero_grad(set_to_none=True)
            results.append(run)
    finally:
        weight_casts.PendingCast.fill = real_fill
    for i, (eager, graphed) in enumerate(zip(*results)):
        assert torch.equal(eager, graphed), f"graphed and eager differ at result {i}"


def test_capture_rejects_parameters_that_are_not_plain_tensors():
    model = GPT(config(False))
    up = model.blocks[1].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach().as_subclass(_NotPlain))
    with pytest.raises(ValueError, match="not plain tensors"):
        model.capture_cuda_graphs(BATCH, SEQ)


def test_capture_checks_the_sequence_length():
    with pytest.raises(ValueError, match="exceeds block_size=16"):
        GPT(config(False)).capture_cuda_graphs(BATCH, 32)


@pytest.mark.gpu
def test_cuda_graphed_gpt_trains_like_the_eager_gpt_on_one_gpu():
    train_body(1, False)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", ["activation", "full", "mlp", "selective"])
def test_cuda_graphed_gpt_recomputes_inside_the_graphs_like_the_eager_gpt(ranks, checkpointing):
    train_body(1, False, checkpointing=checkpointing)
    if torch.cuda.device_count() >= 2:  # with the tp collectives (copy engines, overlap) in the recompute too
        ranks(2).run(train_body, 2, True, 3, 2, None, "auto", checkpointing)


@pytest.mark.gpu
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("overlap_on,comm_backend",
                         [(False, "auto"), (False, "nccl"), (False, "copy_engine"), (True, "auto"), (None, "auto")],
                         ids=["serial-default", "serial-nccl", "serial-copy_engine", "overlap", "defaults"])
def test_cuda_graphed_gpt_trains_like_the_eager_gpt_over_nccl(ranks, sequence_parallel, overlap_on, comm_backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ranks(2).run(train_body, 2, sequence_parallel, 3, 2, overlap_on, comm_backend)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cuda_graphed_gpt_adding_weight_gradients_in_the_gemms_trains_like_the_eager_gpt(ranks, tp):
    """The CPU twins: test_graphed_gpt_adding_weight_gradients_in_the_gemms_*; here cuBLAS adds in the
    GEMMs' epilogue, over NCCL and the copy engines (the library's default overlap above one rank)."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    if tp == 1:
        train_body(1, False, 3, 3, accumulate_grads=True)
    else:
        ranks(tp).run(train_body, tp, True, 3, 3, None, "auto", False, True, True)


def held_gemms_body(tp, overlap_on):
    """(the graphed GPT's training checks, as train_body, against an eager twin that overlaps too: the
    same sums in the same order) and the number of weight-gradient GEMMs its blocks held back for
    their output projections' backward."""
    from tpflash.parallel.held_work import HeldWork
    held, real = [], HeldWork.hold_weight_grad
    HeldWork.hold_weight_grad = lambda self, *a, **k: held.append(1) or real(self, *a, **k)
    try:
        train_body(tp, True, 2, 2, overlap_on, "auto", overlap_eager=True)
    finally:
        HeldWork.hold_weight_grad = real
    return len(held)


def overlap_held_body(tp):
    """Above two ranks, with the overlap on, each block's up-projection weight gradient is held back for
    its output projection's backward inside the graphs, and the graphed GPT trains like the eager one."""
    held = held_gemms_body(tp, True)
    assert held >= config(True).n_layer * 2 * 2, f"{held} weight-gradient GEMMs held back"


def paired_held_body(tp):
    """Where a block's up and down projections have weight gradients of one shape (ffn_hidden / tp ==
    n_embd: here at tp=2), both are held back for its output projection's backward and run there as
    one batched GEMM, and the graphed GPT trains like the eager one."""
    from tpflash.parallel import held_work
    cfg = config(True)
    assert cfg.ffn_hidden // tp == cfg.n_embd, "the test's config must pair the MLP's gradients at this tp"
    batches, real = [], held_work.weight_grads_fp32
    held_work.weight_grads_fp32 = lambda grads, xs, **kw: batches.append(len(grads)) or real(grads, xs, **kw)
    try:
        train_body(tp, True, 2, 2, True, "auto", overlap_eager=True)
    finally:
        held_work.weight_grads_fp32 = real
    assert batches and set(batches) == {2}, f"the held weight gradients' batches: {batches}"


def kept_inputs_body(tp):
    """Above two ranks the captured q/k/v and up projections keep their all-gathered inputs for the
    backward in buffers of their own (one per layer, nothing copied out of the shared workspace),
    the up projections' weight gradients are held for the output projections' backward, and the
    graphed GPT still trains like the eager one over several steps (each replay's forward
    overwrites what the previous backward read)."""
    from tpflash.parallel import peer_collectives
    owners, real = [], peer_collectives.kept_buffer
    peer_collectives.kept_buffer = lambda owner, *args: owners.append(id(owner)) or real(owner, *args)
    try:
        held = held_gemms_body(tp, None)
    finally:
        peer_collectives.kept_buffer = real
    assert len(set(owners)) == 2 * config(True).n_layer, f"{len(set(owners))} layers kept their gathered inputs"
    assert held > 0, "no weight-gradient GEMM was held back"


@pytest.mark.gpu
def test_cuda_graphed_gpt_keeps_each_gathered_input_in_its_own_buffer_over_nccl(ranks):
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 GPUs (the inputs are kept above two ranks)")
    ranks(4).run(kept_inputs_body, 4)


def _reserved_after_capture(model, hand_back: bool) -> int:
    """The allocator's reserved bytes once `model` is captured; hand_back False keeps torch.cuda.empty_cache
    from running (the warm-up passes' cached memory then stays)."""
    real = torch.cuda.empty_cache
    real()
    if not hand_back:
        torch.cuda.empty_cache = lambda: None
    try:
        with amp(torch.device("cuda")):
            model.capture_cuda_graphs(8, 512)
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved()
    finally:
        torch.cuda.empty_cache = real
        model.release_cuda_graphs()
        real()


@pytest.mark.gpu
def test_the_warm_up_passes_hand_their_memory_back_before_the_capture():
    """The capture holds the stack's activations in the graphs' pool; the eager warm-up passes before it
    allocated as much again on a side stream that runs nothing later: that cache is released, so the
    stack's activations are reserved once, not twice. (No CPU twin: no warm-up runs on CPU.)"""
    cfg = GPTConfig.preset("gpt2-tiny", vocab_size=VOCAB, block_size=512, n_layer=4, n_embd=1024, n_head=8,
                           ffn_hidden=4096)
    model = GPT(cfg, device="cuda")
    kept = _reserved_after_capture(model, hand_back=False)
    handed_back = _reserved_after_capture(model, hand_back=True)
    activations = 4 * 8 * 512 * 1024 * 2 * 8  # 4 blocks of [4096 tokens, 1024] bf16, ~8 such tensors each
    assert kept - handed_back > activations / 2, (kept, handed_back)
