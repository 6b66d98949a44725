"""The collectives of tpflash.parallel.comm: values and gradients against what they mean, tp in {2, 4}."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.distributed.checks import assert_close, init_tp, work_dtype
from tpflash.parallel import comm


def _per_rank(ps, dtype, *shape):
    """A different tensor on every rank (seeded by rank), and the list of all ranks' tensors."""
    all_ranks = []
    for r in range(ps.tp_size):
        torch.manual_seed(100 + r)
        all_ranks.append(torch.randn(*shape, device=ps.device, dtype=dtype))
    return all_ranks[ps.tp_rank].clone().requires_grad_(), all_ranks


def gather_along_seq_body(tp, dim):
    """all_gather_along_seq = concatenation of every rank's piece; its backward sums the gradients
    of all ranks and keeps this rank's piece (a reduce-scatter)."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    x, xs = _per_rank(ps, dtype, 2, 3, 4)
    y = comm.all_gather_along_seq(x, ps.tp_group, seq_dim=dim)
    assert_close(y, torch.cat(xs, dim=dim), "all-gather value")
    grads = _per_rank(ps, dtype, *y.shape)[1]  # rank r's upstream gradient
    y.backward(grads[ps.tp_rank])
    expected = sum(grads).chunk(tp, dim=dim)[ps.tp_rank]
    assert_close(x.grad, expected, "all-gather backward (reduce-scatter)")


def reduce_scatter_along_seq_body(tp, dim):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    shape = [2, 3, 4]
    shape[dim] *= tp
    x, xs = _per_rank(ps, dtype, *shape)
    y = comm.reduce_scatter_along_seq(x, ps.tp_group, seq_dim=dim)
    assert_close(y, sum(xs).chunk(tp, dim=dim)[ps.tp_rank], "reduce-scatter value")
    grads = _per_rank(ps, dtype, *y.shape)[1]
    y.backward(grads[ps.tp_rank])
    assert_close(x.grad, torch.cat(grads, dim=dim), "reduce-scatter backward (all-gather)")


def copy_reduce_split_gather_body(tp):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    x, xs = _per_rank(ps, dtype, 3, 4 * tp)
    grads = _per_rank(ps, dtype, 3, 4 * tp)[1]

    y = comm.copy_to_tp_region(x, ps.tp_group)
    assert torch.equal(y, x)
    y.backward(grads[ps.tp_rank])
    assert_close(x.grad, sum(grads), "copy_to_tp_region backward (all-reduce)")

    x.grad = None
    y = comm.reduce_from_tp_region(x, ps.tp_group)
    assert_close(y, sum(xs), "reduce_from_tp_region value")
    y.backward(grads[ps.tp_rank])
    assert torch.equal(x.grad, grads[ps.tp_rank]), "reduce_from_tp_region backward is the identity"

    full = xs[0].detach().clone().requires_grad_()  # the same tensor on every rank
    piece = comm.split_along_dim(full, -1, ps.tp_group)
    assert torch.equal(piece, xs[0].chunk(tp, -1)[ps.tp_rank])
    piece.backward(grads[ps.tp_rank].chunk(tp, -1)[ps.tp_rank])
    assert_close(full.grad, torch.cat([g.chunk(tp, -1)[r] for r, g in enumerate(grads)], -1), "split backward")

    local = xs[ps.tp_rank].detach().clone().requires_grad_()
    gathered = comm.gather_along_dim(local, -1, ps.tp_group)
    assert_close(gathered, torch.cat(xs, -1), "gather value")
    gathered.backward(grads[0].repeat(1, tp))  # replicated downstream gradient
    assert_close(local.grad, grads[0].repeat(1, tp).chunk(tp, -1)[ps.tp_rank], "gather backward (split)")


def async_equals_sync_body(tp):
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    x = _per_rank(ps, dtype, 2 * tp, 3)[0].detach()
    handles = [comm.all_gather_async(x, 1, ps.tp_group), comm.reduce_scatter_async(x, 0, ps.tp_group),
               comm.all_reduce_async(x, ps.tp_group)]  # all in flight at once
    results = [h.wait() for h in handles]
    assert torch.equal(results[0], comm.all_gather(x, 1, ps.tp_group))
    assert_close(results[1], comm.reduce_scatter(x, 0, ps.tp_group), "reduce-scatter")  # sums: NCCL may
    assert_close(results[2], comm.all_reduce(x, ps.tp_group), "all-reduce")  # pick another algorithm


def indivisible_body():
    ps = init_tp(2)
    with pytest.raises(ValueError, match=r"reduce_scatter: size 3 of dim 0 .* is not divisible by the group size 2"):
        comm.reduce_scatter_along_seq(torch.ones(3, 2, device=ps.device), ps.tp_group)
    dist.barrier()  # every rank raised before any collective: the group is still in step


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_along_seq_concatenates_and_reduce_scatters_its_gradient(ranks, tp, dim):
    ranks(tp).run(gather_along_seq_body, tp, dim)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 2])
def test_reduce_scatter_along_seq_sums_and_all_gathers_its_gradient(ranks, tp, dim):
    ranks(tp).run(reduce_scatter_along_seq_body, tp, dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_reduce_split_gather_are_each_others_duals(ranks, tp):
    ranks(tp).run(copy_reduce_split_gather_body, tp)


def copy_many_body(tp):
    """copy_to_tp_region_many: identity forward; each gradient summed over ranks, by one all-reduce."""
    ps = init_tp(tp)
    dtype = work_dtype(ps.device)
    w, b = _per_rank(ps, dtype, 5, 3)[0], _per_rank(ps, dtype, 7)[0]
    grads_w, grads_b = _per_rank(ps, dtype, 5, 3)[1], _per_rank(ps, dtype, 7)[1]
    calls = []
    real_all_reduce = comm.all_reduce
    comm.all_reduce = lambda x, group: calls.append(tuple(x.shape)) or real_all_reduce(x, group)
    try:
        w2, b2 = comm.copy_to_tp_region_many([w, b], ps.tp_group)
        assert torch.equal(w2, w) and torch.equal(b2, b)
        torch.autograd.backward([w2, b2], [grads_w[ps.tp_rank], grads_b[ps.tp_rank]])
    finally:
        comm.all_reduce = real_all_reduce
    assert calls == [(5 * 3 + 7,)], f"expected one all-reduce of 22 elements, got {calls}"
    assert_close(w.grad, sum(grads_w), "first gradient summed over ranks")
    assert_close(b.grad, sum(grads_b), "second gradient summed over ranks")


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_to_tp_region_many_sums_every_gradient_in_one_all_reduce(ranks, tp):
    ranks(tp).run(copy_many_body, tp)


@contextlib.contextmanager
def _counting_all_reduces():
    """The shapes of comm.all_reduce's calls, as a list filled while inside."""
    calls, real_all_reduce = [], comm.all_reduce
    comm.all_reduce = lambda x, group: calls.append(tuple(x.shape)) or real_all_reduce(x, group)
    try:
        yield calls
    finally:
        comm.all_reduce = real_all_reduce


def grad_bucket_body(tp):
    """Inside tp_grad_bucket, every use of a held tensor (through copy_to_tp_region or _many) takes the
    bucket's alias: each gradient is still summed over ranks, by one all-reduce per dtype when the
    whole backward is done, however many uses there were."""
    ps = init_tp(tp)
    w, ws = _per_rank(ps, torch.float32, 5, 3)
    b, bs = _per_rank(ps, torch.float32, 3)
    d, ds = _per_rank(ps, torch.float64, 4)
    with _counting_all_reduces() as calls:
        with comm.tp_grad_bucket([w, b, d], ps.tp_group):
            w1 = comm.copy_to_tp_region(w, ps.tp_group)
            w2, b2 = comm.copy_to_tp_region_many([w, b], ps.tp_group)
            loss = (w1 * w2).sum() + (w2 @ b2).sum() + comm.copy_to_tp_region(d, ps.tp_group).pow(2).sum()
        loss.backward()
    assert sorted(calls) == [(4,), (5 * 3 + 3,)], f"expected one all-reduce per dtype, got {calls}"
    # per-rank gradient of the loss above, summed over ranks
    assert_close(w.grad, sum(2 * wr + br.expand(5, 3) for wr, br in zip(ws, bs)), "twice-used tensor")
    assert_close(b.grad, sum(wr.sum(0) for wr in ws), "tensor used through copy_to_tp_region_many")
    assert_close(d.grad, sum(2 * dr for dr in ds), "float64 tensor (its own all-reduce)")


def nested_grad_buckets_body(tp):
    """A tensor already in an enclosing bucket stays there; only the inner bucket's new tensors get
    the inner bucket's all-reduce. After the bucket closes, copy_to_tp_region reduces on its own."""
    ps = init_tp(tp)
    w, ws = _per_rank(ps, torch.float32, 6)
    c, cs = _per_rank(ps, torch.float32, 2)
    with _counting_all_reduces() as calls:
        with comm.tp_grad_bucket([w], ps.tp_group):
            with comm.tp_grad_bucket([w, c], ps.tp_group):
                loss = comm.copy_to_tp_region(w, ps.tp_group).sum() * comm.copy_to_tp_region(c, ps.tp_group).sum()
        loss.backward()
    assert sorted(calls) == [(2,), (6,)], f"expected the outer bucket to keep w, got {calls}"
    assert_close(w.grad, sum(cr.sum().expand(6) for cr in cs), "outer bucket's tensor")
    assert_close(c.grad, sum(wr.sum().expand(2) for wr in ws), "inner bucket's tensor")
    with _counting_all_reduces() as calls:
        comm.copy_to_tp_region(w, ps.tp_group).sum().backward()
    assert calls == [(6,)], "outside the buckets, copy_to_tp_region reduces by itself"


@pytest.mark.parametrize("tp", [2, 4])
def test_a_grad_bucket_sums_every_held_gradient_in_one_all_reduce_per_dtype(ranks, tp):
    ranks(tp).run(grad_bucket_body, tp)


def test_nested_grad_buckets_reduce_each_tensor_once(ranks):
    ranks(2).run(nested_grad_buckets_body, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_async_collectives_return_what_the_blocking_ones_do(ranks, tp):
    ranks(tp).run(async_equals_sync_body, tp)


def test_indivisible_reduce_scatter_raises_before_communicating(ranks):
    ranks(2).run(indivisible_body)


def test_collectives_are_the_identity_without_a_group():
    x = torch.randn(4, 2)
    for f in (comm.copy_to_tp_region, comm.reduce_from_tp_region, comm.all_gather_along_seq,
              comm.reduce_scatter_along_seq):
        assert f(x, None) is x


def copy_engine_body(tp):
    """TPFLASH_COMM_BACKEND=copy_engine (peer memory) gives NCCL's results: all-gather bit for bit,
    reduce-scatter too at tp=2 (one bf16 add either way), along dim 0 and 1, at sizes that are no
    multiple of the buffer alignment, and in a long alternating sequence (the double buffer)."""
    import os
    from tpflash.parallel import peer_collectives
    ps = init_tp(tp)
    assert ps.device.type == "cuda", "needs one GPU per rank"
    torch.manual_seed(ps.tp_rank)
    cases = [(tp * 1024, 4, 2048), (tp * 3, 5, 7), (tp * 17, 3)]
    for step in range(6):
        for shape in cases:
            full = torch.randn(*shape, device=ps.device, dtype=torch.bfloat16)
            shard = full[: shape[0] // tp] + step
            os.environ["TPFLASH_COMM_BACKEND"] = "copy_engine"
            try:
                assert peer_collectives.available(shard, ps.tp_group)
                got = [comm.all_gather(shard, 0, ps.tp_group), comm.reduce_scatter(full, 0, ps.tp_group),
                       comm.all_gather(full, 1, ps.tp_group)]
            finally:
                del os.environ["TPFLASH_COMM_BACKEND"]
            want = [comm.all_gather(shard, 0, ps.tp_group), comm.reduce_scatter(full, 0, ps.tp_group),
                    comm.all_gather(full, 1, ps.tp_group)]
            assert torch.equal(got[0], want[0]), f"all-gather {shape}"
            assert torch.equal(got[2], want[2]), f"all-gather dim 1 {shape}"
            if tp == 2:
                assert torch.equal(got[1], want[1]), f"reduce-scatter {shape}"
            else:
                assert_close(got[1], want[1], f"reduce-scatter {shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_copy_engine_collectives_equal_nccl(ranks, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(copy_engine_body, tp)


def test_unknown_comm_backend_raises(monkeypatch):
    from tpflash.parallel import peer_collectives
    monkeypatch.setenv("TPFLASH_COMM_BACKEND", "mpi")
    with pytest.raises(ValueError, match="TPFLASH_COMM_BACKEND='mpi' must be one of"):
        peer_collectives.comm_backend()


@pytest.mark.parametrize("backend,for_graphs,peers,expected", [
    ("auto", False, True, False),         # eager work: NCCL
    ("auto", True, True, True),           # work CUDA graphs capture, GPUs that map each other: copy engines
    ("auto", True, False, False),         # ... GPUs that cannot: NCCL
    ("nccl", True, True, False),
    ("copy_engine", False, True, True),
])
def test_the_comm_backend_picks_copy_engines_by_setting_capture_and_peer_access(monkeypatch, backend, for_graphs,
                                                                               peers, expected):
    from tpflash.parallel import peer_collectives
    monkeypatch.setenv("TPFLASH_COMM_BACKEND", backend)
    monkeypatch.setattr(peer_collectives, "available", lambda x, group: True)
    monkeypatch.setattr(peer_collectives, "peer_access", lambda group: peers)
    with peer_collectives.for_graph_capture() if for_graphs else contextlib.nullcontext():
        assert peer_collectives.use_copy_engine(torch.ones(2), object()) is expected


def test_peer_access_needs_one_host_distinct_devices_and_cuda_peer_access():
    from tpflash.parallel.peer_collectives import can_map_peers
    everyone = lambda a, b: True  # noqa: E731
    assert can_map_peers([("h", 0), ("h", 1)], 0, everyone)
    assert not can_map_peers([("h", 0), ("h", 0)], 0, everyone), "one device index per process cannot be checked"
    assert not can_map_peers([("h", 0), ("g", 1)], 0, everyone), "two hosts"
    assert not can_map_peers([("h", 0), ("h", 1)], 0, lambda a, b: False), "no peer access"


def copy_engine_on_cpu_body(tp):
    """On CPU (gloo) the copy_engine setting is not available and the group's collectives serve."""
    import os
    os.environ["TPFLASH_COMM_BACKEND"] = "copy_engine"
    try:
        gather_along_seq_body(tp, 0)
        reduce_scatter_along_seq_body(tp, 0)
    finally:
        del os.environ["TPFLASH_COMM_BACKEND"]


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_engine_backend_falls_back_to_the_group_on_cpu(ranks, tp):
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback; on GPUs test_copy_engine_collectives_equal_nccl covers the backend")
    ranks(tp).run(copy_engine_on_cpu_body, tp)


class _FakeWorkspace:
    def __init__(self):
        self.barriers = 0

    def barrier(self):
        self.barriers += 1


def test_calls_inside_a_graph_epoch_alternate_buffers_per_workspace():
    from tpflash.parallel import peer_collectives
    a, b = _FakeWorkspace(), _FakeWorkspace()
    with peer_collectives.graph_epoch():
        assert [peer_collectives._take_turn(ws) for ws in (a, a, b, a)] == [(0, True), (1, True), (0, True), (0, True)]
    with peer_collectives.graph_epoch():
        assert peer_collectives._take_turn(a) == (0, True), "every epoch starts at buffer 0"
    outside = [peer_collectives._take_turn(a) for _ in range(2)]
    assert {buffer for buffer, _ in outside} == {0, 1} and not any(in_epoch for _, in_epoch in outside), \
        "outside an epoch calls alternate too (two may be open at once) and keep both barriers"


def test_a_graph_epoch_ends_with_one_barrier_on_every_workspace_it_used():
    from tpflash.parallel import peer_collectives
    twice, once, unused = _FakeWorkspace(), _FakeWorkspace(), _FakeWorkspace()
    with peer_collectives.graph_epoch():
        for ws in (twice, once, twice):
            peer_collectives._take_turn(ws)
    assert (twice.barriers, once.barriers, unused.barriers) == (1, 1, 0)


def test_a_graph_epoch_left_by_an_error_issues_no_barrier():
    from tpflash.parallel import peer_collectives
    ws = _FakeWorkspace()
    with pytest.raises(RuntimeError), peer_collectives.graph_epoch():
        peer_collectives._take_turn(ws)
        raise RuntimeError("capture failed")
    assert ws.barriers == 0 and peer_collectives._take_turn(ws)[1] is False


def graph_epoch_body(tp):
    """Copy-engine collectives captured in CUDA graphs (one barrier per call, alternating buffers)
    give NCCL's results when replays of two graphs, of an odd and an even number of calls,
    interleave with each other and with eager copy-engine calls, over rounds of changing inputs."""
    from tpflash.parallel import peer_collectives
    ps = init_tp(tp)
    torch.manual_seed(ps.tp_rank)
    shard = torch.randn(tp * 256, 8, 64, device=ps.device, dtype=torch.bfloat16)
    full = torch.randn(tp * 512, 8, 64, device=ps.device, dtype=torch.bfloat16)

    def odd():  # three calls
        g = peer_collectives.all_gather(shard, ps.tp_group)
        return g, peer_collectives.reduce_scatter(full, ps.tp_group), peer_collectives.all_gather(g[:tp * 256], ps.tp_group)

    def even():  # two calls
        return peer_collectives.reduce_scatter(full * 2, ps.tp_group), peer_collectives.all_gather(full, ps.tp_group)

    for fn in (odd, even):  # warm-up: sizes the workspace before capture
        fn()
    torch.cuda.synchronize()
    graphs, outs = {}, {}
    for name, fn in (("odd", odd), ("even", even)):
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]), peer_collectives.graph_epoch():
            outs[name] = fn()
    nccl = {"odd": lambda: (comm.all_gather(shard, 0, ps.tp_group), comm.reduce_scatter(full, 0, ps.tp_group),
                            comm.all_gather(comm.all_gather(shard, 0, ps.tp_group)[:tp * 256], 0, ps.tp_group)),
            "even": lambda: (comm.reduce_scatter(full * 2, 0, ps.tp_group), comm.all_gather(full, 0, ps.tp_group))}
    for step, order in enumerate(["odd", "even", "odd", "odd", "even", "even", "eager", "odd", "eager", "even"]):
        shard.add_(1)
        full.mul_(-1)
        if order == "eager":
            got, want = odd(), nccl["odd"]()
        else:
            graphs[order].replay()
            got, want = outs[order], nccl[order]()
        for g, w in zip(got, want):
            if tp == 2:  # one bf16 add in either reduce-scatter: bit for bit
                assert torch.equal(g, w), f"step {step} ({order})"
            else:
                assert_close(g, w, f"step {step} ({order})")


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [2, 4])
def test_copy_engine_collectives_in_graph_epochs_equal_nccl(ranks, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks(tp).run(graph_epoch_body, tp)
