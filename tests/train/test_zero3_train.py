"""The trainer's fsdp=zero3: the DDP curve over 20 steps (eager and graphed, micro-batches
accumulated or not), and checkpoints that resume in every other layout and from them."""
import pytest

from tests.train.test_zero_train import STEPS, _assert_same_curve, _config, curve_body

pytestmark = pytest.mark.cpu_ranks  # fp32 curves of several layouts: gloo on CPU even where GPUs are visible

# four blocks (the backward gathers the first two again), sequence parallelism at tp=2; Llama (no
# biases): GPT-2's k_proj bias has an exact gradient of 0, whose rounding noise AdamW turns into
# full steps that move the norm curve by 1e-4 between any two summation orders (FSDP2's against DDP's too)
MODEL = {"preset": "llama-tiny", "n_layer": 4, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "ffn_hidden": 64,
         "sequence_parallel": True}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.train.common import write_corpus
    return write_corpus(str(tmp_path_factory.mktemp("data")))


def _gpt_config(corpus, tp, fsdp, graphs="off", micro=2, **overrides):
    return _config(corpus, tp, fsdp, cuda_graphs=graphs, model=dict(MODEL), train={"micro_batch_size": micro},
                   **overrides)


@pytest.mark.parametrize("world,tp,graphs,micro", [(2, 1, "off", 2), (4, 2, "off", 2), (4, 2, "on", 4),
                                                   (2, 1, "on", 2)],
                         ids=["dp2", "dp2-tp2", "dp2-tp2-graphed", "dp2-graphed-accum2"])
def test_zero3_follows_the_ddp_curve_for_20_steps(ranks, corpus, world, tp, graphs, micro):
    zero3, mode = ranks(world).run(curve_body, _gpt_config(corpus, tp, "zero3", graphs, micro), STEPS, True)[0]
    ddp, _ = ranks(world).run(curve_body, _gpt_config(corpus, tp, "off", "off", micro), STEPS, True)[0]
    assert mode == "zero3"
    _assert_same_curve(zero3, ddp, f"under zero3 (graphs {graphs})")
    assert max(norm for _, norm in ddp) > 1.0, "clip=1 must act in these runs for the norm to be covered"


@pytest.fixture(scope="module")
def uninterrupted(ranks, corpus):
    return ranks(2).run(curve_body, _gpt_config(corpus, 1, "off"), 8, True)[0][0]


# (first half: world, tp, fsdp), (second half: world, tp, fsdp)
RESUMES = {"zero3-to-ddp": ((2, 1, "zero3"), (2, 1, "off")),
           "zero3-dp2-to-fsdp-tp2": ((2, 1, "zero3"), (2, 2, "on")),
           "zero1-to-zero3": ((2, 1, "zero1"), (2, 1, "zero3")),
           "ddp-dp1-to-zero3-dp4": ((1, 1, "off"), (4, 1, "zero3"))}


@pytest.mark.parametrize("first,second", RESUMES.values(), ids=RESUMES.keys())
def test_a_checkpoint_resumes_across_zero3_and_other_layouts(ranks, corpus, tmp_path, uninterrupted, first, second):
    ckpt = {"dir": str(tmp_path / "ckpt")}
    (world, tp, fsdp), (world2, tp2, fsdp2) = first, second
    head, mode = ranks(world).run(curve_body, _gpt_config(corpus, tp, fsdp, checkpoint=ckpt), 4, True)[0]
    tail, mode2 = ranks(world2).run(curve_body, _gpt_config(corpus, tp2, fsdp2, checkpoint=ckpt), 4, True)[0]
    assert (mode.split()[0], mode2.split()[0]) == (fsdp if world > 1 else "off", fsdp2)
    _assert_same_curve(head + tail, uninterrupted, f"saved under {first}, resumed under {second}")
