"""The copy-engine collectives (tpflash.parallel.peer_collectives, TPFLASH_COMM_BACKEND=copy_engine):
NCCL's results over peer memory on GPUs, the group's collectives on CPU, the backend choice, and
the buffers and barriers of graph epochs."""
import contextlib

import pytest
import torch

from tests.distributed.checks import assert_close, environment, init_tp
from tests.distributed.test_comm import gather_along_seq_body, reduce_scatter_along_seq_body
from tpflash.parallel import comm


def gather_by_piece(x, group, stream):
    """A by-piece PeerAllGather of x, its parts read one at a time in rank order (not the order they
    are pushed in) and stacked, on `stream` for the transfers as the overlapped layers do."""
    from tpflash.parallel import peer_collectives
    gather = peer_collectives.PeerAllGather(x, group, stream, keep=False, by_piece=True)
    parts = [gather.piece(r).clone() for r in range(torch.distributed.get_world_size(group))]
    gather.finish()
    return torch.cat(parts)


def gather_whole(x, group, stream):
    """A PeerAllGather of x with whole=True: its parts as one tensor (a clone), or None where the
    slots are padded."""
    from tpflash.parallel import peer_collectives
    gather = peer_collectives.PeerAllGather(x, group, stream, keep=False, by_piece=True, whole=True)
    whole = gather.whole()
    whole = None if whole is None else whole.clone()
    gather.finish()
    return whole


def gather_kept(x, group, stream, owner):
    """A PeerAllGather of x into `owner`'s kept buffer: the gathered tensor returned as it lies there."""
    from tpflash.parallel import peer_collectives
    world = torch.distributed.get_world_size(group)
    kept = peer_collectives.kept_buffer(owner, group, x.device, world * x.numel() * x.element_size())
    gathered = peer_collectives.PeerAllGather(x, group, stream, by_piece=True, kept=kept).finish()
    assert gathered.data_ptr() == kept.view(torch.distributed.get_rank(group), 0, (1,), x.dtype).data_ptr(), \
        "the gathered tensor is not the kept buffer itself"
    return gathered


def copy_engine_body(tp):
    """TPFLASH_COMM_BACKEND=copy_engine (peer memory) gives NCCL's results: all-gather bit for bit
    (read whole, piece by piece as the overlapped layers read it, as one view of this rank's
    buffer where its slots hold no padding, or kept in a buffer of its own that the calls after it
    leave alone, as a layer keeps its input for the backward), reduce-scatter too at tp=2 (one
    bf16 add either way), along dim 0 and 1, at sizes that are no multiple of the buffer alignment,
    and in a long alternating sequence (the double buffer)."""
    from tpflash.parallel import peer_collectives
    ps = init_tp(tp)
    assert ps.device.type == "cuda", "needs one GPU per rank"
    torch.manual_seed(ps.tp_rank)
    cases = [(tp * 1024, 4, 2048), (tp * 3, 5, 7), (tp * 17, 3)]
    side = torch.cuda.Stream()
    owners = [torch.zeros(1) for _ in cases]  # stand-ins for the layers' weights that own kept buffers
    for step in range(6):
        kept = []  # gathered into their own buffers at this step's start, read after the other calls
        for shape, owner in zip(cases, owners):
            shard = torch.randn(*shape, device=ps.device, dtype=torch.bfloat16)[: shape[0] // tp] - step
            kept.append((gather_kept(shard, ps.tp_group, side, owner), comm.all_gather(shard, 0, ps.tp_group)))
        for shape in cases:
            full = torch.randn(*shape, device=ps.device, dtype=torch.bfloat16)
            shard = full[: shape[0] // tp] + step
            with environment(TPFLASH_COMM_BACKEND="copy_engine"):
                assert peer_collectives.available(shard, ps.tp_group)
                got = [comm.all_gather(shard, 0, ps.tp_group), comm.reduce_scatter(full, 0, ps.tp_group),
                       comm.all_gather(full, 1, ps.tp_group), gather_by_piece(shard, ps.tp_group, side),
                       gather_whole(shard, ps.tp_group, side)]
            want = [comm.all_gather(shard, 0, ps.tp_group), comm.reduce_scatter(full, 0, ps.tp_group),
                    comm.all_gather(full, 1, ps.tp_group)]
            assert torch.equal(got[0], want[0]), f"all-gather {shape}"
            assert torch.equal(got[3], want[0]), f"all-gather by piece {shape}"
            if shard.numel() * shard.element_size() % 512:  # padded slots: no whole view
                assert got[4] is None, f"all-gather as one tensor {shape}"
            else:
                assert torch.equal(got[4], want[0]), f"all-gather as one tensor {shape}"
            assert torch.equal(got[2], want[2]), f"all-gather dim 1 {shape}"
            if tp == 2:
                assert torch.equal(got[1], want[1]), f"reduce-scatter {shape}"
            else:
                assert_close(got[1], want[1], f"reduce-scatter {shape}")
        for (got, want), shape in zip(kept, cases):  # the workspace's calls since did not touch them
            assert torch.equal(got, want), f"kept all-gather {shape}, step {step}"
        # a peer's next kept gather pushes into this rank's buffers at once: every rank has read them
        # first (in a model, the collectives between a layer's backward and its next forward see to it)
        torch.distributed.barrier(ps.tp_group)


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


@pytest.mark.parametrize("backend,for_graphs,beside,peers,expected", [
    ("auto", False, False, True, False),  # eager work: NCCL
    ("auto", True, False, True, True),    # work CUDA graphs capture, GPUs that map each other: copy engines
    ("auto", True, False, False, False),  # ... GPUs that cannot: NCCL
    ("auto", False, True, True, True),    # eager, to travel beside a GEMM (the fused loss's): copy engines
    ("auto", False, True, False, False),  # ... GPUs that cannot: NCCL
    ("nccl", True, False, True, False),
    ("nccl", False, True, True, False),
    ("copy_engine", False, False, True, True),
])
def test_the_comm_backend_picks_copy_engines_by_setting_capture_and_peer_access(monkeypatch, backend, for_graphs,
                                                                               beside, peers, expected):
    from tpflash.parallel import peer_collectives
    monkeypatch.setenv("TPFLASH_COMM_BACKEND", backend)
    monkeypatch.setattr(peer_collectives, "available", lambda x, group: True)
    monkeypatch.setattr(peer_collectives, "peer_access", lambda group: peers)
    with peer_collectives.for_graph_capture() if for_graphs else contextlib.nullcontext():
        assert peer_collectives.use_copy_engine(torch.ones(2), object(), beside_compute=beside) is expected


def test_peer_access_needs_one_host_distinct_devices_and_cuda_peer_access():
    from tpflash.parallel.peer_collectives import can_map_peers
    everyone = lambda a, b: True  # noqa: E731
    assert can_map_peers([("h", 0), ("h", 1)], 0, everyone)
    assert not can_map_peers([("h", 0), ("h", 0)], 0, everyone), "one device index per process cannot be checked"
    assert not can_map_peers([("h", 0), ("g", 1)], 0, everyone), "two hosts"
    assert not can_map_peers([("h", 0), ("h", 1)], 0, lambda a, b: False), "no peer access"


def copy_engine_on_cpu_body(tp):
    """On CPU (gloo) the copy_engine setting is not available and the group's collectives serve."""
    with environment(TPFLASH_COMM_BACKEND="copy_engine"):
        gather_along_seq_body(tp, 0)
        reduce_scatter_along_seq_body(tp, 0)


@pytest.mark.parametrize("tp", [2, 4])
def test_copy_engine_backend_falls_back_to_the_group_on_cpu(ranks, tp):
    if torch.cuda.is_available():
        pytest.skip("the CPU fallback; on GPUs test_copy_engine_collectives_equal_nccl covers the backend")
    ranks(tp).run(copy_engine_on_cpu_body, tp)


class _FakeWorkspace:
    """A workspace's turns, barriers and views, in host memory."""

    def __init__(self):
        self.barriers, self.reserved = 0, None
        self.memory = torch.zeros(4096, dtype=torch.uint8)

    def barrier(self):
        self.barriers += 1

    def view(self, rank, offset_bytes, shape, dtype):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self.memory[offset_bytes:offset_bytes + nbytes].view(dtype).view(shape)


def test_the_reserved_slot_is_this_ranks_in_the_next_calls_buffer_and_only_its_gather_may_take_it():
    from tpflash.parallel import peer_workspace
    ws, world, rank, shape = _FakeWorkspace(), 2, 1, (4, 32)  # 512 bytes: one aligned slot
    with peer_workspace.graph_epoch():
        peer_workspace._take_turn(ws)  # buffer 0
        part = peer_workspace.reserve_next_part(ws, world, rank, shape, torch.float32)
        assert part.data_ptr() - ws.memory.data_ptr() == (1 * world + rank) * 512, "not this rank's slot of buffer 1"
        assert peer_workspace._take_turn(ws, part) == (1, True), "the gather of what lies there takes buffer 1"
        peer_workspace.reserve_next_part(ws, world, rank, shape, torch.float32)
        with pytest.raises(RuntimeError, match="the next call on the group is another collective"):
            peer_workspace._take_turn(ws)  # e.g. a reduce-scatter
        assert ws.reserved is None, "a refused call must not leave the reservation for the one after"
        peer_workspace.reserve_next_part(ws, world, rank, shape, torch.float32)
        with pytest.raises(RuntimeError, match="another collective"):
            peer_workspace._take_turn(ws, torch.zeros(shape))  # an all-gather of another tensor


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


def test_symmetric_memory_held_counts_workspaces_outgrown_ones_and_kept_buffers_by_device(monkeypatch):
    from types import SimpleNamespace

    from tpflash.parallel import peer_workspace

    def buffer(nbytes, device):
        return SimpleNamespace(nbytes=nbytes, tensor=SimpleNamespace(device=torch.device(device)))

    monkeypatch.setattr(peer_workspace, "_workspaces", {("group", "cuda:0"): buffer(1024, "cuda:0"),
                                                        ("group", "cuda:1"): buffer(2048, "cuda:1")})
    monkeypatch.setattr(peer_workspace, "_retired", [buffer(512, "cuda:0")])
    monkeypatch.setattr(peer_workspace, "_kept", {1: {("group", "cuda:0", 4096): buffer(4096, "cuda:0")},
                                                  2: {("group", "cuda:0", 256): buffer(256, "cuda:0")}})
    assert peer_workspace.symmetric_bytes(torch.device("cuda:0")) == 1024 + 512 + 4096 + 256
    assert peer_workspace.symmetric_bytes(torch.device("cuda:1")) == 2048
    assert peer_workspace.symmetric_bytes() == 1024 + 2048 + 512 + 4096 + 256


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
    """Copy-engine collectives captured in CUDA graphs (one barrier per call, alternating buffers; an
    all-gather read piece by piece, with its signals) give NCCL's results when replays of two graphs, of an odd and an even number of calls,
    interleave with each other and with eager copy-engine calls, over rounds of changing inputs."""
    from tpflash.parallel import peer_collectives
    ps = init_tp(tp)
    torch.manual_seed(ps.tp_rank)
    shard = torch.randn(tp * 256, 8, 64, device=ps.device, dtype=torch.bfloat16)
    full = torch.randn(tp * 512, 8, 64, device=ps.device, dtype=torch.bfloat16)

    side = torch.cuda.Stream()

    def odd():  # three calls
        g = peer_collectives.all_gather(shard, ps.tp_group)
        return g, peer_collectives.reduce_scatter(full, ps.tp_group), peer_collectives.all_gather(g[:tp * 256], ps.tp_group)

    def even():  # two calls, the gather read piece by piece (a signal per part beside the barrier)
        return peer_collectives.reduce_scatter(full * 2, ps.tp_group), gather_by_piece(full, ps.tp_group, side)

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


def pieces_body(world):
    """reduce_scatter_pieces (sharded gradients: bf16 pieces in, fp32 chunks out) gives an fp32 NCCL
    reduce-scatter of the upcast pieces, eager and replayed from a CUDA graph between eager calls, for
    pieces of several sizes (none a multiple of the buffer alignment)."""
    from tpflash.parallel import peer_collectives
    ps = init_tp(world)
    torch.manual_seed(ps.tp_rank)
    fulls = [torch.randn(world * n, device=ps.device, dtype=torch.bfloat16) for n in (4096 * 3, 5, 1000)]

    def want():
        outs = [torch.empty(f.numel() // world, device=ps.device) for f in fulls]
        comm.reduce_scatter_many(outs, [f.float() for f in fulls], ps.tp_group)
        return torch.cat(outs)

    def pieces():
        return peer_collectives.reduce_scatter_pieces(fulls, ps.tp_group, torch.float32)

    pieces()  # sizes the workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), peer_collectives.graph_epoch():
        captured = pieces(), pieces()
    for step, order in enumerate(["graph", "eager", "graph", "graph", "eager"]):
        for f in fulls:
            f.add_(step + 1)
        if order == "graph":
            graph.replay()
            got = captured
        else:
            got = pieces(), pieces()
        for g in got:
            assert g.dtype == torch.float32
            assert_close(g, want(), f"step {step} ({order})")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_gradients_summed_by_the_copy_engines_equal_an_fp32_reduce_scatter(ranks, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    ranks(world).run(pieces_body, world)


def test_pieces_that_do_not_split_evenly_over_the_ranks_are_refused(monkeypatch):
    from tpflash.parallel import peer_collectives
    monkeypatch.setattr(peer_collectives.dist, "get_world_size", lambda group: 4)
    monkeypatch.setattr(peer_collectives.dist, "get_rank", lambda group: 0)
    with pytest.raises(ValueError, match="every full must be 1-D with a multiple of 4 elements"):
        peer_collectives.reduce_scatter_pieces([torch.zeros(8), torch.zeros(6)], object(), torch.float32)
