"""Overlapped sequence-parallel GEMMs (tpflash.parallel.overlap) equal the plain path and the single-process
reference: on CPU over gloo (the Functions over the group's collectives), on 2 GPUs through peer memory."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed.checks import assert_close, init_tp, work_dtype
from tests.kernels.helpers import ZeroFills
from tpflash.layers import ColumnParallelLinear, RowParallelLinear
from tpflash.layers.linear import _pipelined
from tpflash.parallel import overlap, overlap_gemms, overlap_transfers

SEQ, BATCH, IN, OUT = 8, 3, 16, 24


def _randn(ps, dtype, *shape, seed=1234):
    torch.manual_seed(seed)  # same tensor on every rank
    return torch.randn(*shape, device=ps.device, dtype=dtype)


def _rows(ps, tp):
    return slice(ps.tp_rank * SEQ // tp, (ps.tp_rank + 1) * SEQ // tp)


def _run(layer, x_local, grad_y):
    x = x_local.clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _same(got, want, what):
    (y, gx, gp), (y0, gx0, gp0) = got, want
    assert_close(y, y0, f"{what}: output")
    assert_close(gx, gx0, f"{what}: input grad")
    for name in gp0:
        assert_close(gp[name], gp0[name], f"{what}: {name} grad")


def column_on_off_body(tp, save_gathered_input):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, sequence_parallel=True, save_gathered_input=save_gathered_input,
                                 device=ps.device, dtype=dtype)
    x_local = _randn(ps, dtype, SEQ, BATCH, IN)[_rows(ps, tp)]
    grad_y = _randn(ps, dtype, SEQ, BATCH, OUT // tp, seed=ps.tp_rank)
    overlap.set_overlap(layer, True)
    assert _pipelined(layer), "the overlapped path is not taken"
    on = _run(layer, x_local, grad_y)
    layer.zero_grad()
    overlap.set_overlap(layer, False)
    off = _run(layer, x_local, grad_y)
    _same(on, off, f"column tp={tp}")


def row_on_off_body(tp):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    layer = RowParallelLinear(IN, OUT, sequence_parallel=True, device=ps.device, dtype=dtype)
    h_local = _randn(ps, dtype, SEQ, BATCH, IN // tp, seed=10 + ps.tp_rank)
    grad_y = _randn(ps, dtype, SEQ // tp, BATCH, OUT, seed=20 + ps.tp_rank)
    layer.overlap = True
    assert _pipelined(layer), "the overlapped path is not taken"
    on = _run(layer, h_local, grad_y)
    layer.zero_grad()
    layer.overlap = False
    assert not _pipelined(layer)
    off = _run(layer, h_local, grad_y)
    _same(on, off, f"row tp={tp}")


def send_parts_body(tp):
    """The first peer's rows of a reduce-scatter go in two GEMMs (two sends) where the inner dimension
    is under CHUNK_BELOW_INNER, in one otherwise, like every other peer's; the results agree."""
    ps = init_tp(tp)
    torch.manual_seed(0)
    layer = RowParallelLinear(IN, OUT, sequence_parallel=True, device=ps.device, dtype=torch.float32)
    layer.overlap = True
    h_local = _randn(ps, torch.float32, SEQ, BATCH, IN // tp, seed=10 + ps.tp_rank)
    grad_y = _randn(ps, torch.float32, SEQ // tp, BATCH, OUT, seed=20 + ps.tp_rank)
    make, threshold, sends = overlap_transfers.reduce_scatter, overlap_gemms.CHUNK_BELOW_INNER, []

    def recording(*args):
        pending = make(*args)
        send = pending.send
        pending.send = lambda r, part, row=0: sends.append(r) or send(r, part, row)
        return pending

    overlap_transfers.reduce_scatter = recording
    results = {}
    try:
        for below in (IN // tp + 1, IN // tp):  # the inner dimension under, then at the threshold
            overlap_gemms.CHUNK_BELOW_INNER, sends[:] = below, []
            layer.zero_grad()
            results[below] = _run(layer, h_local, grad_y)
            first = (ps.tp_rank + 1) % tp
            want = [first] * (2 if below > IN // tp else 1) + [(ps.tp_rank + s) % tp for s in range(2, tp)]
            assert sends == want, f"CHUNK_BELOW_INNER={below}: parts sent to {sends}, expected {want}"
    finally:
        overlap_transfers.reduce_scatter, overlap_gemms.CHUNK_BELOW_INNER = make, threshold
    _same(results[IN // tp], results[IN // tp + 1], f"row tp={tp}, one part per peer against two for the first")


def multi_weight_body(tp, save_gathered_input):
    """all_gather_linear with q/k/v-like weights (one with no bias) against F.linear on the full input."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    outs = (OUT, 2 * tp, OUT // 2)
    torch.manual_seed(0)
    full_w = [torch.randn(o, IN, device=ps.device, dtype=dtype) for o in outs]
    full_b = [torch.randn(o, device=ps.device, dtype=dtype) if i != 1 else None for i, o in enumerate(outs)]
    shard = lambda t: None if t is None else t.chunk(tp, 0)[ps.tp_rank].clone().requires_grad_()  # noqa: E731
    ws, bs = [shard(w) for w in full_w], [shard(b) for b in full_b]
    ref_w = [w.clone().requires_grad_() for w in full_w]
    ref_b = [None if b is None else b.clone().requires_grad_() for b in full_b]
    x = _randn(ps, dtype, SEQ, BATCH, IN)
    x_local = x[_rows(ps, tp)].clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    grads = [_randn(ps, dtype, SEQ, BATCH, o, seed=50 + i) for i, o in enumerate(outs)]

    ys = overlap.all_gather_linear(x_local, ws, bs, ps.tp_group, save_gathered_input)
    ys_ref = [F.linear(x_ref, w, b) for w, b in zip(ref_w, ref_b)]
    # each rank's loss covers its own output columns; the reference's covers all of them
    torch.autograd.backward(ys, [g.chunk(tp, -1)[ps.tp_rank] for g in grads])
    torch.autograd.backward(ys_ref, grads)
    for i, (y, y_ref) in enumerate(zip(ys, ys_ref)):
        assert_close(y, y_ref.chunk(tp, -1)[ps.tp_rank], f"output {i}")
        assert_close(ws[i].grad, ref_w[i].grad.chunk(tp, 0)[ps.tp_rank], f"weight {i} grad")
        if bs[i] is not None:
            assert_close(bs[i].grad, ref_b[i].grad.chunk(tp, 0)[ps.tp_rank], f"bias {i} grad")
    # the ranks' losses add up to the reference loss, so this rank's tokens get the reference grad
    assert_close(x_local.grad, x_ref.grad[_rows(ps, tp)], "input grad")


def linear_reduce_scatter_body(tp):
    """linear_reduce_scatter equals reduce-scattering F.linear of the full input-feature product."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    h = _randn(ps, dtype, SEQ, BATCH, IN)
    w = _randn(ps, dtype, OUT, IN, seed=7)
    cols = slice(ps.tp_rank * IN // tp, (ps.tp_rank + 1) * IN // tp)
    h_local, w_local = h[..., cols].clone().requires_grad_(), w[:, cols].clone().requires_grad_()
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    grad = _randn(ps, dtype, SEQ, BATCH, OUT, seed=8)
    y = overlap.linear_reduce_scatter(h_local, w_local, ps.tp_group)
    y_ref = F.linear(h_ref, w_ref)
    assert_close(y, y_ref[_rows(ps, tp)], "output")
    y.backward(grad[_rows(ps, tp)])
    y_ref.backward(grad)
    assert_close(h_local.grad, h_ref.grad[..., cols], "input grad")
    assert_close(w_local.grad, w_ref.grad[:, cols], "weight grad")


def held_body(tp):
    """An output projection, then an up projection, as in a block: with holding on, the up projection's
    backward holds its weight-gradient GEMM and the output projection's backward runs it before its
    own input gradient's GEMM; every gradient is the one computed at once, bit for bit."""
    from tpflash.parallel.held_work import HeldWork, holding_gradients
    ps = init_tp(tp)
    h_local = _randn(ps, torch.float32, SEQ, BATCH, IN // tp, seed=10 + ps.tp_rank)
    w_o = _randn(ps, torch.float32, OUT, IN // tp, seed=11 + ps.tp_rank)
    w_up = _randn(ps, torch.float32, 8, OUT, seed=12 + ps.tp_rank)
    grad = _randn(ps, torch.float32, SEQ, BATCH, 8, seed=13 + ps.tp_rank)

    def run(held):
        h, wo, wu = (t.clone().requires_grad_() for t in (h_local, w_o, w_up))
        y = overlap.linear_reduce_scatter(h, wo, ps.tp_group, held=held)  # [SEQ/tp, BATCH, OUT]
        up, = overlap.all_gather_linear(y, [wu], None, ps.tp_group, save_gathered_input=True, held=held)
        with holding_gradients([held] if held is not None else []):
            up.backward(grad)
        return h.grad, wo.grad, wu.grad

    at_once = run(None)
    held, pending_at_run = HeldWork(), []
    run_held = held.run
    held.run = lambda: pending_at_run.append(len(held.pending)) or run_held()
    got = run(held)
    # the output projection's forward (nothing held), its backward (the up projection's GEMM), the end
    assert pending_at_run == [0, 1, 0], f"held work pending at each run: {pending_at_run}"
    for name, a, b in zip(("input", "output projection weight", "up projection weight"), got, at_once):
        assert torch.equal(a, b), f"{name} grad differs when the up projection's weight gradient is held"


def paired_body(tp):
    """An output projection, an up projection and a down projection whose weight gradients have one shape,
    as in a block with a 4x MLP at tp=4: with holding on, the down projection holds its weight gradient
    over its gathered grad_y, the up projection its own, and the output projection's backward runs both
    as one batch; every gradient is the one computed at once (fp32: one GEMM each), bit for bit on CPU; on
    GPUs cuBLAS may pick another kernel for the kept copy of grad_y than for the shared buffer's view."""
    from tpflash.parallel import held_work
    from tpflash.parallel.held_work import HeldWork, holding_gradients
    ps = init_tp(tp)
    h_local = _randn(ps, torch.float32, SEQ, BATCH, IN // tp, seed=10 + ps.tp_rank)
    w_o = _randn(ps, torch.float32, OUT, IN // tp, seed=11 + ps.tp_rank)
    w_up = _randn(ps, torch.float32, OUT, OUT, seed=12 + ps.tp_rank)  # [ffn/tp, hidden], ffn/tp == hidden
    w_down = _randn(ps, torch.float32, OUT, OUT, seed=13 + ps.tp_rank)  # [hidden, ffn/tp]
    grad = _randn(ps, torch.float32, SEQ // tp, BATCH, OUT, seed=14 + ps.tp_rank)

    def run(held):
        h, wo, wu, wd = (t.clone().requires_grad_() for t in (h_local, w_o, w_up, w_down))
        y = overlap.linear_reduce_scatter(h, wo, ps.tp_group, held=held)  # [SEQ/tp, BATCH, OUT]
        up, = overlap.all_gather_linear(y, [wu], None, ps.tp_group, save_gathered_input=True, held=held)
        down = overlap.linear_reduce_scatter(torch.relu(up), wd, ps.tp_group, grad_held_for=held)
        with holding_gradients([held] if held is not None else []):  # as GraphedBlocks: the gradients read after it
            return torch.autograd.grad(down, (h, wo, wu, wd), grad)

    at_once = run(None)
    held, batches, pending_at_run = HeldWork(), [], []
    run_held, batch = held.run, held_work.weight_grads_fp32
    held.run = lambda: pending_at_run.append(len(held.pending)) or run_held()
    held_work.weight_grads_fp32 = lambda grads, xs, **kw: batches.append(len(grads)) or batch(grads, xs, **kw)
    try:
        got = run(held)
    finally:
        held_work.weight_grads_fp32 = batch
    # the output projection's forward (nothing held), its backward (the down and up GEMMs), the end
    assert pending_at_run == [0, 2, 0], f"held work pending at each run: {pending_at_run}"
    assert batches == [2], f"the held weight gradients' batches: {batches}"
    for name, a, b in zip(("input", "output projection weight", "up projection weight", "down projection weight"),
                          got, at_once):
        what = f"{name} grad when the MLP's weight gradients are held and batched"
        if a.is_cuda:
            assert_close(a, b, what, tol=1e-6)
        else:
            assert torch.equal(a, b), what


def autocast_body(tp):
    """Under bf16 autocast the overlapped MLP computes in bf16 like F.linear would (same output dtype),
    and returns fp32 parameter gradients, matching the plain path."""
    ps = init_tp(tp)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(ColumnParallelLinear(IN, 4 * IN, sequence_parallel=True), torch.nn.GELU(),
                              RowParallelLinear(4 * IN, IN, sequence_parallel=True)).to(ps.device)
    x_local = _randn(ps, torch.float32, SEQ, BATCH, IN)[_rows(ps, tp)]
    results = []
    for on in (True, False):
        mlp.zero_grad()
        overlap.set_overlap(mlp, on)
        with torch.autocast(ps.device.type, dtype=torch.bfloat16):
            assert mlp[0](x_local).dtype == torch.bfloat16, f"column output not bf16 (overlap={on})"
            y = mlp(x_local.clone().requires_grad_())
        y.float().square().sum().backward()
        results.append((y.detach(), {n: p.grad.clone() for n, p in mlp.named_parameters()}))
    (y_on, g_on), (y_off, g_off) = results
    assert y_on.dtype == y_off.dtype, f"output dtype {y_on.dtype} with overlap, {y_off.dtype} without"
    assert_close(y_on, y_off, "output", tol=2e-2)
    for name, grad in g_off.items():
        assert g_on[name].dtype == torch.float32, f"{name} grad is {g_on[name].dtype}"
        assert_close(g_on[name], grad, f"{name} grad", tol=3e-2)


def indivisible_sequence_body(tp):
    ps = init_tp(tp)
    h = torch.randn(SEQ + 1, BATCH, IN // tp, device=ps.device)
    with pytest.raises(ValueError, match=f"sequence length {SEQ + 1} .* not divisible by tp={tp}"):
        overlap.linear_reduce_scatter(h, torch.randn(OUT, IN // tp, device=ps.device), ps.tp_group)


def wrong_bias_body(tp):
    ps = init_tp(tp)
    h = torch.randn(SEQ, BATCH, IN // tp, device=ps.device)
    w = torch.randn(OUT, IN // tp, device=ps.device)
    with pytest.raises(ValueError, match=rf"bias of shape \({OUT + 1},\) does not match .* must be \[{OUT}\]"):
        overlap.linear_reduce_scatter(h, w, ps.tp_group, torch.randn(OUT + 1, device=ps.device))
    dist.barrier()  # every rank raised before any collective: the group is still in step


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_reduce_scatter_rejects_a_bias_of_the_wrong_size_before_communicating(ranks, tp):
    ranks(tp).run(wrong_bias_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("save_gathered_input", [True, False])
def test_column_overlap_matches_overlap_off(ranks, tp, save_gathered_input):
    ranks(tp).run(column_on_off_body, tp, save_gathered_input)


@pytest.mark.parametrize("tp", [2, 4])
def test_row_overlap_matches_overlap_off(ranks, tp):
    ranks(tp).run(row_on_off_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_first_peers_rows_are_sent_in_two_parts_only_below_the_inner_dimension_threshold(ranks, tp):
    ranks(tp).run(send_parts_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("save_gathered_input", [True, False])
def test_all_gather_linear_with_several_weights_matches_reference(ranks, tp, save_gathered_input):
    ranks(tp).run(multi_weight_body, tp, save_gathered_input)


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_reduce_scatter_matches_reference(ranks, tp):
    ranks(tp).run(linear_reduce_scatter_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_held_weight_gradient_runs_in_the_next_row_backward_and_equals_the_one_at_once(ranks, tp):
    ranks(tp).run(held_body, tp)


@pytest.mark.parametrize("tp", [2, 4])
def test_same_shape_up_and_down_weight_gradients_are_held_and_batched_and_equal_the_ones_at_once(ranks, tp):
    ranks(tp).run(paired_body, tp)


def test_overlap_under_bf16_autocast_matches_overlap_off(ranks):
    ranks(2).run(autocast_body, 2)


def test_indivisible_sequence_raises_before_any_collective(ranks):
    ranks(2).run(indivisible_sequence_body, 2)


def block_on_off_body(tp, mlp, n_kv_head):
    """A sequence-parallel transformer block: q/k/v and up/gate share one overlapped gather."""
    from tpflash.layers import ParallelTransformerBlock
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    block = ParallelTransformerBlock(IN, 4, n_kv_head, mlp=mlp, norm="rmsnorm", position="rotary",
                                     sequence_parallel=True, device=ps.device, dtype=dtype)
    x_local = _randn(ps, dtype, SEQ, BATCH, IN)[_rows(ps, tp)]
    grad_y = _randn(ps, dtype, SEQ // tp, BATCH, IN, seed=ps.tp_rank)

    def run():
        x = x_local.clone().requires_grad_()
        out, residual = block(x)
        (out + residual).backward(grad_y)
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        block.zero_grad()
        return (out + residual).detach(), x.grad, grads

    overlap.set_overlap(block, False)
    plain = run()
    overlap.set_overlap(block, True)
    gathers, real = [], overlap.all_gather_linear  # the column GEMM groups that took the overlapped path
    overlap.all_gather_linear = lambda *args, **kw: gathers.append(1) or real(*args, **kw)
    try:
        overlapped = run()
    finally:
        overlap.all_gather_linear = real
    assert len(gathers) == 2, f"q/k/v and up/gate should each take one overlapped gather, took {len(gathers)}"
    _same(overlapped, plain, f"block mlp={mlp} n_kv_head={n_kv_head}")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mlp, n_kv_head", [("swiglu", 1), ("gelu", 4)])
def test_block_with_overlap_matches_overlap_off(ranks, tp, mlp, n_kv_head):
    ranks(tp).run(block_on_off_body, tp, mlp, n_kv_head)


def _finish_as_parts(self, own):
    """A stand-in for the copy engines' unsummed parts on the group's reduce-scatter: [own, sum - own]."""
    total = self.finish(own)
    return [own, total - own]


def _two_blocks(tp, kinds, **block_kw):
    """Two overlapped blocks of `kinds` ((mlp, norm) each), this rank's input and an output gradient, and
    run(after_forward) -> (output, input grad, parameter grads) of one forward and backward through
    both, after_forward(the first block's output) called between them. The group's own collectives
    carry the overlapped layers' transfers, on GPUs too (the copy engines leave parts unsummed only
    inside graph captures, which test_graphed_blocks' train_body checks)."""
    from tpflash.layers import ParallelTransformerBlock
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    torch.manual_seed(0)
    blocks = [ParallelTransformerBlock(IN, 4, 2, mlp=mlp, norm=norm, sequence_parallel=True, device=ps.device,
                                       dtype=dtype, **block_kw) for mlp, norm in kinds]
    for block in blocks:
        overlap.set_overlap(block, True)
    x_local = _randn(ps, dtype, SEQ, BATCH, IN)[_rows(ps, tp)]
    grad_y = _randn(ps, dtype, SEQ // tp, BATCH, IN, seed=ps.tp_rank)

    def run(after_forward=lambda first_out: None):
        x = x_local.clone().requires_grad_()
        first_out, residual = blocks[0](x)
        out, residual = blocks[1](first_out, residual)
        after_forward(first_out)
        (out + residual).backward(grad_y)
        grads = {f"{i}.{n}": p.grad.clone() for i, b in enumerate(blocks) for n, p in b.named_parameters()}
        for block in blocks:
            block.zero_grad()
        return (out + residual).detach(), x.grad, grads
    return blocks, run


def block_parts_body(tp):
    """Blocks whose row layers hand the next norm their reduce-scatter's parts (the output projection's to
    mlp_norm; with hand_output_parts, the MLP's to the next block's attn_norm) compute what blocks
    handing over the sums compute, forward and backward."""
    blocks, run = _two_blocks(tp, [("swiglu", "rmsnorm")] * 2, position="rotary")
    handed = []
    reach = overlap_transfers.copy_engines_reach
    overlap_transfers.copy_engines_reach = lambda x, group: False
    real = overlap_transfers.GroupReduceScatter.finish_parts
    try:
        summed = run(lambda first_out: handed.append(isinstance(first_out, tuple)))
        overlap_transfers.GroupReduceScatter.finish_parts = _finish_as_parts
        blocks[0].hand_output_parts(True)
        parted = run(lambda first_out: handed.append(isinstance(first_out, tuple)))
    finally:
        overlap_transfers.copy_engines_reach = reach
        overlap_transfers.GroupReduceScatter.finish_parts = real
        blocks[0].hand_output_parts(False)
    assert handed == [False, True], f"the first block's output should come as parts only when handed: {handed}"
    _same(parted, summed, f"blocks handing parts, tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_blocks_handing_the_reduce_scatters_parts_to_the_next_norm_match_blocks_handing_sums(ranks, tp):
    ranks(tp).run(block_parts_body, tp)


def _finish_as_world_parts(self, own):
    """A stand-in for the copy engines' unsummed parts on the group's reduce-scatter, one per rank:
    [own, d/2, d/4, d/4] (at tp=4) for d = sum - own."""
    rest = self.finish(own) - own
    world = dist.get_world_size(self.group)
    shares = [0.5 ** min(i + 1, world - 2) for i in range(world - 1)]  # sum to 1
    return [own, *(rest * share for share in shares)]


def block_grad_parts_body(tp):
    """Blocks whose q/k/v and up projections hand their input gradient's reduce-scatter parts to the
    norms before them (take_input_grad_parts), which add them in their backward, compute what blocks
    handing over the sums compute, forward and backward; every such projection handed tp parts.
    No q/k/v biases: the k bias's gradient is zero but for rounding (softmax ignores a shift shared
    by every key), which adding the parts in another order changes."""
    blocks, run = _two_blocks(tp, [("swiglu", "rmsnorm"), ("gelu", "layernorm")], qkv_bias=False)
    handed = []

    def spy(self, own):
        parts = _finish_as_world_parts(self, own)
        handed.append(len(parts))
        return parts

    reach, real = overlap_transfers.copy_engines_reach, overlap_transfers.GroupReduceScatter.finish_parts
    send_all, width = overlap_gemms._send_all_parts, overlap_gemms.ONE_GEMM_FROM_WIDTH
    one_gemm_sends = []
    overlap_gemms._send_all_parts = lambda *args: one_gemm_sends.append(1) or send_all(*args)
    overlap_transfers.copy_engines_reach = lambda x, group: False
    try:
        summed = run()
        overlap_transfers.GroupReduceScatter.finish_parts = spy
        for block in blocks:
            block.take_input_grad_parts(True)
        # the output projections' forward parts counted out: the backward's only
        parted = run(lambda first_out: handed.clear())
        assert not one_gemm_sends, "these projections are too narrow for their input gradient in one GEMM"
        overlap_gemms.ONE_GEMM_FROM_WIDTH = 0  # every projection's input gradient in one GEMM
        one_gemm = run()
    finally:
        overlap_transfers.copy_engines_reach = reach
        overlap_transfers.GroupReduceScatter.finish_parts = real
        overlap_gemms._send_all_parts, overlap_gemms.ONE_GEMM_FROM_WIDTH = send_all, width
        for block in blocks:
            block.take_input_grad_parts(False)
    assert handed[:4] == [tp] * 4, f"each block's q/k/v and up projections should hand {tp} parts: {handed}"
    _same(parted, summed, f"blocks handing input gradient parts, tp={tp}")
    assert len(one_gemm_sends) == 4, f"the q/k/v and up projections' input gradients in one GEMM: {one_gemm_sends}"
    _same(one_gemm, summed, f"blocks handing input gradient parts computed in one GEMM, tp={tp}")


@pytest.mark.parametrize("tp", [2, 4])
def test_blocks_whose_projections_hand_input_gradient_parts_to_the_norms_match_blocks_handing_sums(ranks, tp):
    ranks(tp).run(block_grad_parts_body, tp)


def parts_backward_body(tp):
    """The row layer's parts other than this rank's own carry no gradient, and its backward has none
    made for them: no [s/tp, b, out] zeros per part (a memset each on a GPU, every block and step)."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    layer = RowParallelLinear(IN, OUT, bias=True, sequence_parallel=True, device=ps.device, dtype=dtype)
    h = _randn(ps, dtype, SEQ, BATCH, IN // tp, seed=ps.tp_rank).requires_grad_()
    reach, real = overlap_transfers.copy_engines_reach, overlap_transfers.GroupReduceScatter.finish_parts
    overlap_transfers.copy_engines_reach = lambda x, group: False
    overlap_transfers.GroupReduceScatter.finish_parts = _finish_as_parts
    try:
        parts = overlap.linear_reduce_scatter(h, layer.weight, ps.tp_group, layer.bias, parts=True)
    finally:
        overlap_transfers.copy_engines_reach, overlap_transfers.GroupReduceScatter.finish_parts = reach, real
    assert len(parts) == 2 and not parts[1].requires_grad, "the stand-in should hand this rank's part and one more"
    fills = ZeroFills()
    with fills:
        (parts[0].float().square().sum() + parts[1].float().sum()).backward()
    assert h.grad is not None and layer.weight.grad is not None
    assert tuple(parts[1].shape) not in fills.shapes, f"zeros made in the backward: {fills.shapes}"


@pytest.mark.parametrize("tp", [2, 4])
def test_the_row_layers_backward_makes_no_zeros_for_the_parts_it_handed_on(ranks, tp):
    ranks(tp).run(parts_backward_body, tp)


def all_bodies(tp):
    """Every check above in one rank process: on CPU over gloo's collectives (the Functions' stand-ins),
    on GPUs through peer memory, where the copy engines must have carried the transfers."""
    from tpflash.parallel import peer_collectives
    calls = []
    real = peer_collectives.PeerAllGather, peer_collectives.PeerReduceScatter
    peer_collectives.PeerAllGather = lambda *a, **k: calls.append("gather") or real[0](*a, **k)
    peer_collectives.PeerReduceScatter = lambda *a, **k: calls.append("scatter") or real[1](*a, **k)
    try:
        for save_gathered_input in (True, False, None):  # None: the default, gather again
            column_on_off_body(tp, save_gathered_input)
        row_on_off_body(tp)
        multi_weight_body(tp, True)  # one weight without a bias: zeros stand in for it
        multi_weight_body(tp, False)
        linear_reduce_scatter_body(tp)
        autocast_body(tp)
        held_body(tp)
        paired_body(tp)
        block_on_off_body(tp, "swiglu", 1)
        block_on_off_body(tp, "gelu", 4)
    finally:
        peer_collectives.PeerAllGather, peer_collectives.PeerReduceScatter = real
    if torch.cuda.is_available():
        assert {"gather", "scatter"} <= set(calls), f"the copy engines did not carry the transfers: {calls}"
    else:
        assert not calls, "peer memory used on CPU"


@pytest.mark.gpu
def test_overlap_matches_overlap_off_through_peer_memory(ranks):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ranks(2).run(all_bodies, 2)


class _PiecesOnly:
    """A gather that gives its parts one by one and never as one tensor (as PeerAllGather does where
    its slots are padded)."""

    def __init__(self, full, world, rank):
        self.parts, self.rank = full.chunk(world), rank

    def order(self):
        return [(self.rank + step) % len(self.parts) for step in range(len(self.parts))]

    def piece(self, r):
        return self.parts[r]

    def whole(self):
        return None


class _OneTensor(_PiecesOnly):
    """A gather that gives its parts as one tensor (PeerAllGather's whole(), the group's all-gather)."""

    def __init__(self, full, world, rank):
        super().__init__(full, world, rank)
        self.full = full

    def whole(self):
        return self.full


class _CountsPieces(_OneTensor):
    """_OneTensor that records the pieces asked for."""

    def __init__(self, full, world, rank):
        super().__init__(full, world, rank)
        self.asked = []

    def piece(self, r):
        self.asked.append(r)
        return super().piece(r)


def test_a_row_backward_runs_held_work_first_then_its_input_gradient_in_one_gemm():
    from tpflash.parallel.held_work import HeldWork
    torch.manual_seed(0)
    world, rows = 4, 6
    grad_y, w, h = torch.randn(world * rows, 5), torch.randn(5, 7), torch.randn(world * rows, 7)
    order = []
    held = HeldWork()
    held.hold(lambda: order.append("held"))
    gather = _CountsPieces(grad_y, world, rank=1)
    grad_h = torch.empty(world * rows, 7)
    real_mm = torch.mm
    torch.mm = lambda *a, **k: order.append("mm") or real_mm(*a, **k)
    try:
        grad_w = overlap_gemms._gather_multiply_both(gather, w, h, grad_h, held)
    finally:
        torch.mm = real_mm
    assert order[:2] == ["held", "mm"] and gather.asked == [], f"held work, then one GEMM: {order}, {gather.asked}"
    assert_close(grad_h, grad_y @ w, "input gradient")
    assert_close(grad_w, grad_y.t() @ h, "weight gradient")
    by_pieces = _CountsPieces(grad_y, world, rank=1)
    overlap_gemms._gather_multiply_both(by_pieces, w, h, grad_h, HeldWork())  # nothing held
    assert by_pieces.asked == [1, 2, 3, 0], f"without held work, rank by rank from this rank's: {by_pieces.asked}"
    assert_close(grad_h, grad_y @ w, "input gradient by pieces")


@pytest.mark.parametrize("model, width, tp, one", [
    ("gpt-2.7b q/k/v", 7680, 2, True), ("gpt-2.7b q/k/v", 7680, 4, True),
    ("llama-1b q/k/v", 3072, 2, True), ("llama-1b q/k/v", 3072, 4, False)])
def test_a_column_layers_input_gradient_is_one_gemm_where_its_weight_gradient_outlasts_the_pushes(model, width, tp,
                                                                                                 one):
    assert overlap_gemms._one_input_grad_gemm(width // tp, tp) is one, f"{model} at tp={tp}"


@pytest.mark.parametrize("gathered_is_grad", [True, False])
def test_the_weight_gradient_summed_over_pieces_equals_the_one_gemm_over_the_gathered_rows(gathered_is_grad):
    torch.manual_seed(0)
    world, rows = 4, 6
    gathered, other = torch.randn(world * rows, 5), torch.randn(world * rows, 7)
    by_pieces = overlap_gemms._weight_grad_with_gathered(_PiecesOnly(gathered, world, rank=2), other, gathered_is_grad)
    one_gemm = overlap_gemms._weight_grad_with_gathered(_OneTensor(gathered, world, rank=2), other, gathered_is_grad)
    want = gathered.t() @ other if gathered_is_grad else other.t() @ gathered
    assert by_pieces.dtype == one_gemm.dtype == torch.float32
    assert_close(by_pieces, want, "summed over the pieces")
    assert_close(one_gemm, want, "one GEMM")
