"""A fresh run's model is built on the meta device and initialised module by module, and holds exactly
what a whole build from the run's seed holds, under each way of holding it over dp (CPU ranks)."""
import pytest
import torch

from tests.train.common import tiny_config, write_corpus
from tpflash.models import GPT
from tpflash.parallel.sharding import full_state_dict
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks

MODEL = {"preset": "llama-tiny", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "ffn_hidden": 64,
         "block_size": 16}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data")))


def fresh_body(cfg):
    """(the devices GPT was built on, whether the trainer's weights equal a whole seeded build's)."""
    built, real = [], GPT.__init__

    def spy(self, *args, **kwargs):
        built.append(str(kwargs.get("device")))
        real(self, *args, **kwargs)

    GPT.__init__ = spy
    try:
        trainer = Trainer(cfg)
    finally:
        GPT.__init__ = real
    got = full_state_dict(trainer.model)
    torch.manual_seed(cfg.seed)
    want = full_state_dict(GPT(trainer.model_config, device=trainer.device))
    return built, sorted(k for k in want if not torch.equal(got[k], want[k]))


@pytest.mark.parametrize("fsdp,tp", [("off", 1), ("off", 2), ("on", 1), ("zero3", 1), ("zero3", 2)])
def test_a_fresh_model_is_built_on_meta_and_holds_the_seeded_values(ranks, corpus, fsdp, tp):
    cfg = tiny_config(corpus, tp=tp, dtype="fp32", fsdp=fsdp, model=MODEL)
    for built, differing in ranks(4 if fsdp != "off" else tp).run(fresh_body, cfg):
        assert built == ["meta"], f"GPT built on {built}"
        assert not differing, f"parameters unlike a whole build from the seed: {differing}"
