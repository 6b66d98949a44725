"""Ranks launched with different configs or data are refused at start-up, on every rank, by name."""
import os
import re

import numpy as np
import pytest
import torch.distributed as dist

from tests.train.common import TEXT, tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.parallel.agreement import disagreements
from tpflash.train.fingerprint import tokens_digest
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks  # the tiny trainers run on CPU: gloo on CPU even where GPUs are visible


def _start(cfg):
    """Build a Trainer; return the error message it raised, or None."""
    try:
        Trainer(cfg, TinyConfig, TinyLM)
    except ValueError as e:
        return str(e)
    return None


def start_with_rank_lr(corpus):
    return _start(tiny_config(corpus, train={"lr": 0.01 * (1 + dist.get_rank())}))


def start_with_rank_tp(corpus):
    return _start(tiny_config(corpus, tp=2 - dist.get_rank()))


def start_with_rank_corpus(directory, same_text):
    path = os.path.join(directory, f"rank{dist.get_rank()}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "corpus.txt"), "w") as f:
        f.write(TEXT if same_text or dist.get_rank() == 0 else TEXT.replace("return", "yield "))
    return _start(tiny_config(os.path.join(path, "corpus.txt")))


def test_ranks_with_different_learning_rates_are_refused_naming_the_key(ranks, tmp_path):
    errors = ranks(2).run(start_with_rank_lr, write_corpus(str(tmp_path)))
    assert errors[0] == errors[1], "every rank must raise the same error"
    assert "train.lr: 0.01 on ranks [0]; 0.02 on ranks [1]" in errors[0]


def test_ranks_asking_for_different_layouts_are_refused_before_building_the_mesh(ranks, tmp_path):
    # tp=2 (dp=1) on rank 0 and tp=1 (dp=2) on rank 1 are each valid for a world of 2; without the
    # check the two ranks build different meshes and go on (to hang or compute garbage later)
    errors = ranks(2).run(start_with_rank_tp, write_corpus(str(tmp_path)))
    assert errors[0] == errors[1]
    assert "tp: 2 on ranks [0]; 1 on ranks [1]" in errors[0]


def test_ranks_reading_different_tokens_are_refused(ranks, tmp_path):
    errors = ranks(2).run(start_with_rank_corpus, str(tmp_path), False)
    assert errors[0] == errors[1]
    assert re.search(r"training tokens \(count:digest\): \d+:\w+ on ranks \[0\]; \d+:\w+ on ranks \[1\]", errors[0])
    assert "data.path" not in errors[0], "paths differ by design here; only the tokens should be named"


def test_ranks_may_name_the_same_tokens_by_different_paths(ranks, tmp_path):
    assert ranks(2).run(start_with_rank_corpus, str(tmp_path), True) == [None, None]


def test_digest_changes_with_a_token_inside_a_read_window():
    tokens = np.arange(100_000, dtype=np.uint16)
    changed = tokens.copy()
    changed[0] += 1
    assert tokens_digest(tokens) != tokens_digest(changed)
    assert tokens_digest(tokens).startswith("100000:")


def test_disagreements_name_at_most_three_keys_then_count_the_rest():
    same = {f"k{i}": "1" for i in range(5)}
    other = {f"k{i}": "2" for i in range(5)}
    lines = disagreements([same, other])
    assert lines == ["k0: 1 on ranks [0]; 2 on ranks [1]", "k1: 1 on ranks [0]; 2 on ranks [1]",
                     "k2: 1 on ranks [0]; 2 on ranks [1]", "... and 2 more"]
    assert disagreements([same, dict(same)]) == []
