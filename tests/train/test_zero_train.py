"""The trainer's fsdp=zero1: the DDP curve over 20 steps, graphed or not, and checkpoints that resume in
every other layout (DDP, FSDP, another dp or tp) and from them."""
import pytest
import torch

from tests.distributed.checks import assert_close
from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks  # fp32 curves of several layouts: gloo on CPU even where GPUs are visible

STEPS = 20


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data")))


def curve_body(cfg, steps, use_gpt=False):
    """Resume from cfg.checkpoint.dir if set and present, run `steps` steps, save if a dir is set;
    returns (per-step loss averaged over dp, grad norm), with (eval loss, 0) after every
    train.eval_interval-th step where set, and the trainer's dp mode ("zero1 in graphs" where the
    graphs carry its reduction)."""
    trainer = Trainer(cfg) if use_gpt else Trainer(cfg, TinyConfig, TinyLM)
    curve = []
    for _ in range(steps):
        out = trainer.train_step()
        curve.append((trainer._dp_mean(out["loss"]), out["grad_norm"].item()))
        if cfg.train.eval_interval and trainer.step % cfg.train.eval_interval == 0:
            curve.append((trainer.evaluate(), 0.0))
    trainer.save()
    in_graphs = getattr(trainer, "zero", None) is not None and trainer.zero.graph_sync is not None
    return curve, trainer.dp_mode + (" in graphs" if in_graphs else "")


def _config(corpus, tp, fsdp, **overrides):
    train = {"steps": STEPS, "batch_size": 8, "micro_batch_size": 2, **overrides.pop("train", {})}
    return tiny_config(corpus, tp=tp, fsdp=fsdp, train=train, **overrides)


def _assert_same_curve(got, ref, what):
    for i, name in enumerate(("loss", "grad-norm")):
        assert_close(torch.tensor([c[i] for c in got]), torch.tensor([c[i] for c in ref]), f"{name} curve {what}",
                     tol=1e-5)


@pytest.mark.parametrize("world,tp", [(2, 1), (4, 2)], ids=["dp2", "dp2-tp2"])
def test_zero1_follows_the_ddp_curve_for_20_steps(ranks, corpus, world, tp):
    zero1, mode = ranks(world).run(curve_body, _config(corpus, tp, "zero1"), STEPS)[0]
    ddp, _ = ranks(world).run(curve_body, _config(corpus, tp, "off"), STEPS)[0]
    assert mode == "zero1"
    _assert_same_curve(zero1, ddp, "under zero1")
    assert max(norm for _, norm in ddp) > 1.0, "clip=1 must act in these runs for the norm to be covered"


@pytest.mark.parametrize("micro", [2, 4], ids=["accum2-reduced-after", "accum1-reduced-in-graph"])
def test_graphed_gpt_under_zero1_follows_the_ddp_curve(ranks, corpus, micro):
    # CPU: the graphs' eager stand-in, so this checks that the captured stack's gradients land in the
    # flat buffers (accumulated over micro-batches, or reduced inside the graphs with one micro-batch
    # per step), and that the parameters it reads are the gathered ones; with evaluation between steps
    model = {"preset": "gpt2-tiny", "n_layer": 2, "n_embd": 32, "sequence_parallel": True}
    train = {"micro_batch_size": micro, "eval_interval": 2}
    graphed, mode = ranks(4).run(curve_body, _config(corpus, 2, "zero1", cuda_graphs="on", model=model, train=train),
                                 6, True)[0]
    ddp, _ = ranks(4).run(curve_body, _config(corpus, 2, "off", cuda_graphs="off", model=model, train=train), 6,
                          True)[0]
    assert mode == ("zero1" if micro == 2 else "zero1 in graphs")
    _assert_same_curve(graphed, ddp, "of the graphed GPT under zero1")


@pytest.fixture(scope="module")
def uninterrupted(ranks, corpus):
    return ranks(2).run(curve_body, _config(corpus, 1, "off"), 8)[0][0]


# (first half: world, tp, fsdp), (second half: world, tp, fsdp)
RESUMES = {"zero1-to-ddp": ((2, 1, "zero1"), (2, 1, "off")),
           "zero1-to-fsdp": ((2, 1, "zero1"), (2, 1, "on")),
           "zero1-dp2-to-tp2-dp1": ((2, 1, "zero1"), (2, 2, "off")),
           "ddp-to-zero1-dp4": ((2, 1, "off"), (4, 1, "zero1")),
           "fsdp-tp2-to-zero1-dp2": ((2, 2, "on"), (2, 1, "zero1"))}


@pytest.mark.parametrize("first,second", RESUMES.values(), ids=RESUMES.keys())
def test_a_checkpoint_resumes_across_zero1_and_other_layouts(ranks, corpus, tmp_path, uninterrupted, first, second):
    ckpt = {"dir": str(tmp_path / "ckpt")}
    (world, tp, fsdp), (world2, tp2, fsdp2) = first, second
    head, mode = ranks(world).run(curve_body, _config(corpus, tp, fsdp, checkpoint=ckpt), 4)[0]
    tail, mode2 = ranks(world2).run(curve_body, _config(corpus, tp2, fsdp2, checkpoint=ckpt), 4)[0]
    assert (mode, mode2) == (fsdp, fsdp2)
    _assert_same_curve(head + tail, uninterrupted, f"saved under {first}, resumed under {second}")
