"""fsdp=auto: zero3 (everything sharded, blocks graphed) on CUDA at cp=1; elsewhere zero1 (AdamW state sharded,
weights replicated) where that fits in half the device, else FSDP."""
import pytest
import torch

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.models import GPT, GPTConfig
from tpflash.train.build import fsdp_choice, zero3_blocker
from tpflash.train.config import TrainConfig
from tpflash.train.loop import Trainer

GIB = 2**30
H100 = 80 * GIB
CUDA = torch.device("cuda")


def _gpt(**overrides):
    """A GPT on the meta device: what zero3_blocker looks at (its blocks and config), no memory."""
    return GPT(GPTConfig.preset("gpt2-tiny", vocab_size=64, block_size=16, n_layer=2, n_embd=32, n_head=4, **overrides),
               device=torch.device("meta"))


@pytest.mark.parametrize("dp", [1, 4])
@pytest.mark.parametrize("setting", ["on", "off", "zero1", "zero3"])
def test_an_explicit_setting_is_obeyed_at_any_dp(dp, setting):
    assert fsdp_choice(setting, dp, 10**12, H100) == (setting, "")


def test_auto_never_shards_a_single_replica():
    assert fsdp_choice("auto", 1, 10**12, H100) == ("off", " (auto: dp=1)")


def test_auto_holds_the_model_with_zero3_where_nothing_blocks_it():
    mode, why = fsdp_choice("auto", 2, 8_000_000_000, H100, zero3_blocker=None)
    assert mode == "zero3" and "on CUDA" in why, why


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_zero3_is_picked_on_cuda_at_any_tp_for_graphable_blocks(tp):
    assert zero3_blocker(TrainConfig(tp=tp), _gpt(), CUDA) is None


@pytest.mark.parametrize("fp8", ["rowwise", "tensorwise"])
def test_zero3_is_picked_for_fp8_models_too(fp8):
    assert zero3_blocker(TrainConfig(), _gpt(fp8=fp8), CUDA) is None


def test_zero3_is_left_to_explicit_requests_on_cpu_at_cp_above_one_and_with_dropout():
    assert zero3_blocker(TrainConfig(), _gpt(), torch.device("cpu")) == "CPU"
    assert zero3_blocker(TrainConfig(cp=2), _gpt(), CUDA) == "cp=2"
    assert "dropout=0.1" in zero3_blocker(TrainConfig(), _gpt(dropout=0.1), CUDA)
    assert zero3_blocker(TrainConfig(cuda_graphs="off"), _gpt(), CUDA) == "blocks not CUDA-graphed"



def test_auto_shards_the_optimizer_state_where_weights_and_gradients_fit_in_half_the_device():
    mode, why = fsdp_choice("auto", 4, 2_000_000_000, H100)  # llama-3-8b at tp=4: 10 bytes/param = 18.6 GiB
    assert mode == "zero1" and "AdamW's state 18.63 GiB per rank, device 80 GiB" in why, why


def test_auto_shards_everything_where_that_would_take_more_than_half_the_device():
    mode, why = fsdp_choice("auto", 4, 8_000_000_000, H100)  # llama-3-8b at tp=1: 74.5 GiB per rank under zero1
    assert mode == "on" and "74.51 GiB per rank, device 80 GiB: more than half" in why, why


def fsdp_body(cfg):
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    return trainer.dp_mode, trainer.dp_mode_why


@pytest.mark.cpu_ranks
def test_every_rank_of_a_dp2_run_makes_the_same_auto_choice(ranks, tmp_path):
    corpus = write_corpus(str(tmp_path))
    auto = ranks(2).run(fsdp_body, tiny_config(corpus, tp=1))
    assert auto[0] == auto[1] and auto[0][0] == "zero1", "a tiny model keeps its weights whole on every rank"
    forced = ranks(2).run(fsdp_body, tiny_config(corpus, tp=1, fsdp="on"))
    assert forced == [("on", ""), ("on", "")]
