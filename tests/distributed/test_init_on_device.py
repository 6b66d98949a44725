"""GPT.init_on_device: a model built on the meta device, laid out (replicated, FSDP2, fsdp=zero3) and given
storage gets the values of a whole-model build from the same seed, on every tp and dp layout, and the
random stream continues where that build leaves it."""
import pytest
import torch

from tests.distributed.checks import init_tp
from tpflash import parallel
from tpflash.models import GPT, GPTConfig
from tpflash.parallel.sharding import full_state_dict

pytestmark = pytest.mark.cpu_ranks

SEED = 5


def config(family):
    if family == "llama":
        return GPTConfig.preset("llama-tiny", vocab_size=67, block_size=16, n_layer=2, n_embd=32, n_head=4,
                                n_kv_head=2, ffn_hidden=64, sequence_parallel=True)
    return GPTConfig.preset("gpt2-tiny", vocab_size=67, block_size=16, n_layer=2, n_embd=32, n_head=4,
                            ffn_hidden=64, sequence_parallel=True)


def init_body(tp, layout, family):
    ps = init_tp(tp)
    cfg = config(family)
    torch.manual_seed(SEED)
    whole = GPT(cfg, device=ps.device)
    after_whole = torch.rand(3)
    want = full_state_dict(whole)

    torch.manual_seed(123)  # a state init_on_device must not depend on
    model = GPT(cfg, device=torch.device("meta"))
    if layout == "fsdp":
        parallel.apply_fsdp(model, ps)
    if layout == "zero3":
        parallel.shard_blocks(model, ps)
        parallel.materialize_outside_blocks(model, ps.device)
    else:
        model.to_empty(device=ps.device)
    model.init_on_device(ps.device, SEED)
    assert torch.equal(torch.rand(3), after_whole), "the random stream does not continue as after the whole build"
    got = full_state_dict(model)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("tp,layout", [(1, "replicated"), (2, "replicated"), (1, "fsdp"), (2, "fsdp"), (1, "zero3"),
                                       (2, "zero3")])
def test_a_model_built_on_meta_and_initialised_on_device_equals_the_whole_build(ranks, tp, layout):
    ranks(4 if layout != "replicated" else tp).run(init_body, tp, layout, "llama")


def test_the_gpt2_family_is_initialised_alike(ranks):
    ranks(2).run(init_body, 2, "fsdp", "gpt2")


@pytest.mark.gpu
def test_a_model_initialised_on_the_gpu_equals_the_whole_build_there():
    """The CUDA twin: the values come from the GPU's random stream, as in a whole build on the GPU."""
    device = torch.device("cuda")
    cfg = config("llama")
    torch.manual_seed(SEED)
    want = GPT(cfg, device=device).state_dict()
    after_whole = torch.rand(3, device=device)
    model = GPT(cfg, device=torch.device("meta"))
    model.to_empty(device=device)
    model.init_on_device(device, SEED)
    assert torch.equal(torch.rand(3, device=device), after_whole)
    got = model.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key
