"""When the overlapped path runs: the layers' flags, the environment's default and the decision a CUDA
graph capture makes once and hands to the captured layers (one process)."""
import pytest
import torch
import torch.nn.functional as F

from tpflash.layers import ParallelTransformerBlock, RowParallelLinear
from tpflash.layers.linear import _overlapped, _pipelined
from tpflash.models import GPT, GPTConfig
from tpflash.parallel import overlap, peer_collectives

TP2 = type("Group", (), {"size": lambda self: 2})()


@pytest.fixture
def unset(monkeypatch):
    """overlap as if TPFLASH_OVERLAP had been unset at import."""
    monkeypatch.setattr(overlap, "ENVIRONMENT_SETTING", None)


def test_overlap_is_off_by_default(unset):
    assert not overlap.layer_overlaps(None)
    assert not _pipelined(RowParallelLinear(16, 24, sequence_parallel=True))  # tp=1 never overlaps


@pytest.mark.parametrize("value,expected", [("1", True), ("on", True), ("0", False), ("off", False), ("", None)])
def test_the_environment_sets_the_default(monkeypatch, value, expected):
    monkeypatch.setenv("TPFLASH_OVERLAP", value)
    monkeypatch.delenv("TPFLASH_OVERLAP_BACKEND", raising=False)
    assert overlap._env_setting() is expected


def test_a_layers_own_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setattr(overlap, "ENVIRONMENT_SETTING", True)  # TPFLASH_OVERLAP=1
    assert _overlapped(True, 0, TP2, None)
    assert not _overlapped(True, 0, TP2, False), "a layer's own flag wins"
    monkeypatch.setattr(overlap, "ENVIRONMENT_SETTING", False)
    assert _overlapped(True, 0, TP2, True)
    assert not _overlapped(False, 0, TP2, True), "nothing to overlap without sequence parallelism"
    assert not _overlapped(True, 1, TP2, True), "only sequence-first activations"


def test_set_overlap_sets_every_flag_of_a_model_the_head_included():
    model = GPT(GPTConfig.preset("gpt2-tiny", vocab_size=64, block_size=8, n_layer=2, n_embd=32, n_head=4))
    overlap.set_overlap(model, True)
    flags = [m for m in model.modules() if "overlap" in vars(m)]
    kinds = {type(m).__name__ for m in flags}
    assert {"ColumnParallelLinear", "RowParallelLinear", "GPT"} <= kinds
    assert all(m.overlap is True for m in flags)
    overlap.set_overlap(model, None)
    assert all(m.overlap is None for m in flags)


def test_set_overlap_takes_only_true_false_or_none():
    with pytest.raises(ValueError, match=r"set_overlap\(enabled='yes'\): enabled must be True, False or None"):
        overlap.set_overlap(RowParallelLinear(8, 8), "yes")


@pytest.mark.parametrize("setting,comm_backend,reach,expected", [
    (None, "auto", True, True),      # captured, the copy engines reach the group: overlapped
    (None, "auto", False, False),    # GPUs that cannot map each other's memory: serial
    (None, "nccl", True, False),     # NCCL asked for: serial
    (False, "auto", True, False),    # TPFLASH_OVERLAP=0
    (True, "auto", False, True),     # TPFLASH_OVERLAP=1: overlapped (over the group's collectives)
])
def test_a_capture_decides_once_from_the_environment_then_the_copy_engines(monkeypatch, setting, comm_backend,
                                                                           reach, expected):
    monkeypatch.setattr(overlap, "ENVIRONMENT_SETTING", setting)
    monkeypatch.setattr(peer_collectives, "comm_backend", lambda: comm_backend)
    asked = []
    monkeypatch.setattr(peer_collectives, "reachable", lambda x, group: asked.append(1) or reach)
    assert overlap.capture_decision(torch.ones(2), TP2) is expected
    assert len(asked) <= 1, "the copy engines' reach was asked more than once"


def test_a_capture_hands_its_decision_to_the_layers_left_to_the_default_and_takes_it_back():
    block = ParallelTransformerBlock(32, 4, 2, mlp="swiglu", norm="rmsnorm", position="rotary", sequence_parallel=True)
    block.mlp.down_proj.overlap = False  # a layer's own flag: kept through the capture
    defaulted = [m for m in block.modules() if "overlap" in vars(m) and m.overlap is None]
    assert defaulted
    with overlap.overlapping_for_capture([block], True) as overlapped:
        assert overlapped and peer_collectives.capturing_for_graphs()
        assert all(m.overlap is True for m in defaulted) and block.mlp.down_proj.overlap is False
    assert all(m.overlap is None for m in defaulted) and block.mlp.down_proj.overlap is False
    assert not peer_collectives.capturing_for_graphs()


def test_a_capture_says_it_did_not_overlap_when_every_layer_is_off():
    block = ParallelTransformerBlock(32, 4, 2, mlp="swiglu", norm="rmsnorm", position="rotary", sequence_parallel=True)
    overlap.set_overlap(block, False)
    with overlap.overlapping_for_capture([block], True) as overlapped:
        assert not overlapped


def test_no_default_overlap_at_tp1(unset):
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


def test_the_gathered_input_is_kept_for_the_backward_unless_the_layer_says():
    from tpflash.parallel.overlap import keeps_gathered_input
    assert keeps_gathered_input(None) is True
    assert keeps_gathered_input(False) is False and keeps_gathered_input(True) is True
