"""Which overlap runs where: the switch, its environment variables and the backend choice (one process)."""
import pytest
import torch
import torch.nn.functional as F

from tpflash.layers import RowParallelLinear
from tpflash.layers.linear import _pipelined
from tpflash.parallel import overlap, pieces_overlap


def test_switch_is_off_by_default(monkeypatch):
    monkeypatch.delenv("TPFLASH_OVERLAP", raising=False)
    assert not overlap.overlap_enabled()
    assert not _pipelined(RowParallelLinear(16, 24, sequence_parallel=True))  # tp=1 never pipelines


def test_pieces_divide_the_local_sequence(monkeypatch):
    monkeypatch.delenv("TPFLASH_OVERLAP_PIECES", raising=False)
    assert [pieces_overlap.num_pieces(n) for n in (1, 2, 3, 6, 8, 1024)] == [1, 2, 3, 3, 4, 4]
    assert pieces_overlap.num_pieces(8, 2) == 2
    monkeypatch.setenv("TPFLASH_OVERLAP_PIECES", "8")
    assert pieces_overlap.num_pieces(1024) == 8


def test_switch_follows_context_then_environment(monkeypatch):
    monkeypatch.setenv("TPFLASH_OVERLAP", "0")
    assert not overlap.overlap_enabled()
    with overlap.overlap_comm(True):
        assert overlap.overlap_enabled() and overlap.resolve_overlap(None)
        assert not overlap.resolve_overlap(False)
    monkeypatch.setenv("TPFLASH_OVERLAP", "1")
    assert overlap.overlap_enabled()
    with overlap.overlap_comm(False):
        assert not overlap.overlap_enabled()


@pytest.mark.parametrize("env,capturing,reach,expected", [
    ({}, False, True, False),                                   # eager work: serial collectives
    ({}, True, True, True),                                     # captured, copy engines reach: overlapped
    ({}, True, False, False),                                   # captured, GPUs that cannot map each other
    ({"TPFLASH_OVERLAP": "0"}, True, True, False),              # asked off
    ({"TPFLASH_COMM_BACKEND": "nccl"}, True, True, False),      # NCCL asked for
    ({"TPFLASH_OVERLAP_BACKEND": "pieces"}, True, True, False),  # only the copy-engine variant is a default
    ({"TPFLASH_OVERLAP": "1"}, False, False, True),             # asked on: everywhere
])
def test_default_overlap_is_the_copy_engines_inside_graph_capture(monkeypatch, env, capturing, reach, expected):
    from tpflash.parallel import peer_collectives
    for key in ("TPFLASH_OVERLAP", "TPFLASH_COMM_BACKEND", "TPFLASH_OVERLAP_BACKEND"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(peer_collectives, "reachable", lambda x, group: reach)
    monkeypatch.setattr(peer_collectives, "capturing_for_graphs", lambda: capturing)
    assert overlap.resolve_overlap(None, torch.ones(2), object()) is expected
    assert overlap.resolve_overlap(False, torch.ones(2), object()) is False, "a layer's own flag wins"


def test_auto_overlap_backend_is_copy_engine_where_the_copy_engines_reach(monkeypatch):
    from tpflash.parallel import peer_collectives
    monkeypatch.delenv("TPFLASH_OVERLAP_BACKEND", raising=False)
    monkeypatch.delenv("TPFLASH_COMM_BACKEND", raising=False)
    for reach, expected in ((True, "copy_engine"), (False, "pieces")):
        monkeypatch.setattr(peer_collectives, "reachable", lambda x, group: reach)
        assert overlap.overlap_backend(torch.ones(2), object()) == expected
    assert overlap.overlap_backend() == "auto"


def test_tp1_is_plain_linear():
    x, w, b = torch.randn(4, 2, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(overlap.all_gather_linear(x, [w], [b])[0], F.linear(x, w, b))
    assert torch.equal(overlap.linear_reduce_scatter(x, w), F.linear(x, w))


def test_unknown_overlap_backend_raises(monkeypatch):
    monkeypatch.setenv("TPFLASH_OVERLAP_BACKEND", "ring")
    with pytest.raises(ValueError, match="TPFLASH_OVERLAP_BACKEND='ring' must be one of"):
        overlap.overlap_backend()
