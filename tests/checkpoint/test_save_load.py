"""Single-process save/load: extras, RNG, keep-K, numbering, name-keyed optimizer state, clear errors."""
import os
import random
import shutil
import threading

import pytest
import torch

import tpflash
from tests.checkpoint.tiny_model import TinyLM, build, full_state, make_optimizer, train
from tpflash.checkpoint import directory
from tpflash.checkpoint.api import WRITER_THREADS, writer_threads
from tpflash.checkpoint.layout import Chunk


pytestmark = pytest.mark.usefixtures("single_process")


def _trained(steps=2):
    model = build(seed=0, tp=False)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(steps))
    return model, optimizer


class Sampler:
    """A stand-in for a data sampler: anything with state_dict/load_state_dict."""

    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_stateful_extras_are_restored_in_place_and_plain_extras_returned(tmp_path):
    model, optimizer = _trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scheduler.step()
    tpflash.checkpoint.save(tmp_path, model, optimizer, step=7, scheduler=scheduler, data=Sampler(96),
                            run_name="tiny", tokens=4096)
    fresh = build(seed=1, tp=False)
    fresh_optimizer = make_optimizer(fresh)
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=1, gamma=0.5)
    sampler = Sampler()
    info = tpflash.checkpoint.load(tmp_path, fresh, fresh_optimizer, scheduler=fresh_scheduler, data=sampler)
    assert info == {"step": 7, "run_name": "tiny", "tokens": 4096}
    assert sampler.position == 96
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == 5e-3


def test_rng_states_are_restored(tmp_path):
    model, _ = _trained(0)
    torch.manual_seed(123)
    random.seed(5)
    tpflash.checkpoint.save(tmp_path, model, step=0)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(999)
    random.seed(999)
    tpflash.checkpoint.load(tmp_path, model)
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_dropout_streams_of_the_model_are_restored(tmp_path):
    from tpflash.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2-tiny", dropout=0.5)).train()
    idx = torch.randint(0, model.config.vocab_size, (2, 8))
    model(idx, idx)  # advances the dropout streams
    tpflash.checkpoint.save(tmp_path, model, step=1)
    expected = model(idx, idx)
    model(idx, idx)  # advance further: the load must rewind
    tpflash.checkpoint.load(tmp_path, model)
    assert torch.equal(model(idx, idx), expected), "dropout after load differs from dropout after save"


def test_optimizer_state_is_keyed_by_parameter_name(tmp_path):
    model, optimizer = _trained()
    tpflash.checkpoint.save(tmp_path, model, optimizer, step=2)
    fresh = build(seed=1, tp=False)
    reordered = torch.optim.AdamW(list(fresh.parameters())[::-1], lr=1e-2, weight_decay=0.1)
    tpflash.checkpoint.load(tmp_path, fresh, reordered)
    expected, got = full_state(model, optimizer), full_state(fresh, reordered)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_loading_restores_hyperparameters_but_keeps_the_optimizers_own_kernels(tmp_path):
    model, optimizer = _trained()  # foreach AdamW (the CPU default), weight_decay 0.1
    tpflash.checkpoint.save(tmp_path, model, optimizer, step=2)
    fresh = build(seed=1, tp=False)
    fused = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.5, fused=True)  # as a GPU run builds it
    tpflash.checkpoint.load(tmp_path, fresh, fused)
    group = fused.param_groups[0]
    assert group["fused"] is True and not group["foreach"], "a checkpoint must not turn the fused kernels off"
    assert group["weight_decay"] == 0.1, "hyper-parameters come back as torch's load_state_dict gives them"
    expected, got = full_state(model, optimizer), full_state(fresh, fused)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    train(fresh, fused, range(2, 3))  # and the fused kernel runs on the loaded state


def test_keep_k_keeps_only_the_newest_checkpoints(tmp_path):
    model, optimizer = _trained(0)
    for step in (10, 20, 30, 40):
        tpflash.checkpoint.save(tmp_path, model, optimizer, step=step, keep=2)
    assert [s for s, _ in directory.committed_steps(str(tmp_path))] == [30, 40]
    assert tpflash.checkpoint.latest(tmp_path) == os.path.join(tmp_path, "step_40")
    directory.wait_for_deletions()
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_30", "step_40"]


def test_a_pruned_checkpoint_leaves_the_root_at_once_and_is_deleted_in_the_background(tmp_path, monkeypatch):
    model, optimizer = _trained(0)
    release, real_rmtree = threading.Event(), shutil.rmtree
    monkeypatch.setattr(directory.shutil, "rmtree", lambda path, *a: (release.wait(), real_rmtree(path, *a)))
    for step in (1, 2):
        tpflash.checkpoint.save(tmp_path, model, optimizer, step=step, keep=1)  # returns with step_1's files still there
    doomed = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-old-step_1-")]
    assert [s for s, _ in directory.committed_steps(str(tmp_path))] == [2] and len(doomed) == 1
    release.set()
    directory.wait_for_deletions()
    assert not os.path.exists(os.path.join(tmp_path, doomed[0]))


def test_save_without_step_numbers_after_the_newest(tmp_path):
    model, _ = _trained(0)
    assert tpflash.checkpoint.save(tmp_path, model).endswith("step_0")
    assert tpflash.checkpoint.save(tmp_path, model).endswith("step_1")
    assert tpflash.checkpoint.load(tmp_path, model)["step"] == 1


def test_load_from_an_empty_root_raises_file_not_found(tmp_path):
    assert tpflash.checkpoint.latest(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        tpflash.checkpoint.load(tmp_path, TinyLM())


def test_mismatched_shape_names_the_first_mismatched_tensor(tmp_path):
    model, _ = _trained(0)
    tpflash.checkpoint.save(tmp_path, model, step=0)
    wider = TinyLM(vocab=14)
    with pytest.raises(ValueError, match=r"shape mismatch for 'embed.weight'.*\(13, 8\).*\(14, 8\)"):
        tpflash.checkpoint.load(tmp_path, wider)


def test_missing_manifest_makes_the_checkpoint_corrupt(tmp_path):
    model, _ = _trained(0)
    path = tpflash.checkpoint.save(tmp_path, model, step=0)
    os.remove(os.path.join(path, directory.MANIFEST))
    with pytest.raises(tpflash.checkpoint.CheckpointCorruptError, match="manifest.json is missing"):
        tpflash.checkpoint.load(path, model)


def test_bad_arguments_raise_value_error(tmp_path):
    model, _ = _trained(0)
    with pytest.raises(ValueError, match="step=-1 must be an integer >= 0"):
        tpflash.checkpoint.save(tmp_path, model, step=-1)
    with pytest.raises(ValueError, match="keep=-2 must be an integer >= 0"):
        tpflash.checkpoint.save(tmp_path, model, keep=-2)
    tpflash.checkpoint.save(tmp_path, model, step=0)
    with pytest.raises(ValueError, match="extras \\['sampler'\\] were passed to load"):
        tpflash.checkpoint.load(tmp_path, model, sampler=Sampler())



def test_host_state_is_written_by_several_threads():
    state = {"w": Chunk(torch.zeros(4, 4), (0, 0), torch.Size((8, 4))), "meta": b"x"}
    assert writer_threads(state) == WRITER_THREADS > 1


@pytest.mark.gpu
def test_state_on_the_gpu_is_written_by_one_thread_whose_copies_overlap_the_writing():
    state = {"w": Chunk(torch.zeros(4, 4, device="cuda"), (0, 0), torch.Size((8, 4))), "b": torch.zeros(2)}
    assert writer_threads(state) == 1
