"""fsdp=auto shards over dp only where the replicated weights, gradients and AdamW state would not fit."""
import pytest

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train.build import fsdp_choice
from tpflash.train.loop import Trainer

GIB = 2**30
H100 = 80 * GIB


@pytest.mark.parametrize("dp", [1, 4])
def test_an_explicit_setting_is_obeyed_at_any_dp(dp):
    assert fsdp_choice("on", dp, 10, H100) == (True, "")
    assert fsdp_choice("off", dp, 10**12, H100) == (False, "")


def test_auto_never_shards_a_single_replica():
    assert fsdp_choice("auto", 1, 10**12, H100) == (False, " (auto: dp=1)")


def test_auto_replicates_what_fits_in_half_the_device():
    on, why = fsdp_choice("auto", 4, 650_000_000, H100)  # gpt-1.3b at tp=2: 10.4 GB of state per rank
    assert not on and "9.69 GiB per rank, device 80 GiB: replicated over dp" in why


def test_auto_shards_what_would_take_more_than_half_the_device():
    on, why = fsdp_choice("auto", 4, 3_500_000_000, H100)  # a 7B model at tp=2: 56 GB of state per rank
    assert on and "52.15 GiB per rank, device 80 GiB: more than half" in why


def fsdp_body(cfg):
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    return trainer.fsdp, trainer.fsdp_why


@pytest.mark.cpu_ranks
def test_every_rank_of_a_dp2_run_makes_the_same_auto_choice(ranks, tmp_path):
    corpus = write_corpus(str(tmp_path))
    auto = ranks(2).run(fsdp_body, tiny_config(corpus, tp=1))
    assert auto[0] == auto[1] and auto[0][0] is False, "a tiny model is replicated over dp"
    forced = ranks(2).run(fsdp_body, tiny_config(corpus, tp=1, fsdp="on"))
    assert forced == [(True, ""), (True, "")]
