"""When the overlapped path runs: the switch, its environment variables and the decision a CUDA graph
capture makes once (one process)."""
import pytest
import torch
import torch.nn.functional as F

from tpflash.layers import RowParallelLinear
from tpflash.layers.linear import _overlapped, _pipelined
from tpflash.parallel import overlap, peer_collectives


@pytest.fixture
def settings(monkeypatch):
    """overlap's settings as if TPFLASH_OVERLAP had been unset at import."""
    monkeypatch.setattr(overlap, "_settings", [None])
    return overlap._settings


def test_switch_is_off_by_default(settings):
    assert not overlap.overlap_enabled()
    assert not _pipelined(RowParallelLinear(16, 24, sequence_parallel=True))  # tp=1 never overlaps


@pytest.mark.parametrize("value,expected", [("1", True), ("on", True), ("0", False), ("off", False), ("", None)])
def test_the_environment_sets_the_default(monkeypatch, value, expected):
    monkeypatch.setenv("TPFLASH_OVERLAP", value)
    monkeypatch.delenv("TPFLASH_OVERLAP_BACKEND", raising=False)
    assert overlap._env_setting() is expected


def test_the_context_wins_over_the_environment_and_the_layer_flag_over_both(settings):
    settings[0] = False  # TPFLASH_OVERLAP=0
    group = type("Group", (), {"size": lambda self: 2})()
    assert not _overlapped(True, 0, group, None)
    with overlap.overlap_comm(True):
        assert overlap.overlap_enabled() and _overlapped(True, 0, group, None)
        assert not _overlapped(True, 0, group, False), "a layer's own flag wins"
        assert not _overlapped(False, 0, group, True), "nothing to overlap without sequence parallelism"
        assert not _overlapped(True, 1, group, True), "only sequence-first activations"
        with overlap.overlap_comm(False):
            assert not overlap.overlap_enabled()
    assert not overlap.overlap_enabled()


@pytest.mark.parametrize("setting,comm_backend,reach,expected", [
    (None, "auto", True, True),      # captured, the copy engines reach the group: overlapped
    (None, "auto", False, False),    # GPUs that cannot map each other's memory: serial
    (None, "nccl", True, False),     # NCCL asked for: serial
    (False, "auto", True, False),    # asked off
    (True, "auto", False, True),     # asked on: overlapped (over the group's collectives)
])
def test_a_capture_decides_once_from_the_setting_then_the_copy_engines(monkeypatch, settings, setting,
                                                                       comm_backend, reach, expected):
    settings[0] = setting
    monkeypatch.setenv("TPFLASH_COMM_BACKEND", comm_backend)
    asked = []
    monkeypatch.setattr(peer_collectives, "reachable", lambda x, group: asked.append(1) or reach)
    group = type("Group", (), {"size": lambda self: 2})()
    assert not overlap.overlap_enabled() or setting
    with overlap.for_graph_capture(torch.ones(2), group) as decision:
        assert decision is expected and overlap.overlap_enabled() is expected
        assert peer_collectives.capturing_for_graphs()
        for _ in range(3):
            _overlapped(True, 0, group, None)
    assert len(asked) <= 1, "the copy engines' reach was asked more than once per capture"
    assert overlap.overlap_enabled() is bool(setting) and not peer_collectives.capturing_for_graphs()


def test_no_default_overlap_at_tp1(settings):
    group = type("Group", (), {"size": lambda self: 1})()
    assert overlap.capture_decision(torch.ones(2), group) is False


def test_tp1_is_plain_linear():
    x, w, b = torch.randn(4, 2, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(overlap.all_gather_linear(x, [w], [b])[0], F.linear(x, w, b))
    assert torch.equal(overlap.linear_reduce_scatter(x, w), F.linear(x, w))


@pytest.mark.parametrize("backend", ["pieces", "symm_mem", "ring"])
def test_an_overlap_backend_other_than_the_copy_engines_raises(monkeypatch, backend):
    monkeypatch.setenv("TPFLASH_OVERLAP_BACKEND", backend)
    with pytest.raises(ValueError, match=f"TPFLASH_OVERLAP_BACKEND='{backend}' is not supported: .* copy engines only"):
        overlap._env_setting()
    for accepted in ("copy_engine", "auto"):
        monkeypatch.setenv("TPFLASH_OVERLAP_BACKEND", accepted)
        overlap._env_setting()
