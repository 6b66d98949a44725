"""The training loop on CPU ranks with a tiny tp model: tp=2 and dp=2 follow the single-process run."""
import os

import pytest
import torch

from tests.distributed.checks import assert_close
from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train.loop import Trainer

# the curves compare fp32 runs of several world sizes: gloo on CPU even where GPUs are visible
pytestmark = pytest.mark.cpu_ranks

STEPS = 6


def losses_body(cfg):
    """Run STEPS optimizer steps; return per-step (loss averaged over dp, global grad norm)."""
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    curve = []
    for _ in range(STEPS):
        out = trainer.train_step()
        curve.append((trainer._dp_mean(out["loss"]), out["grad_norm"].item()))
    return curve


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def single(ranks, corpus):
    return ranks(1).run(losses_body, tiny_config(corpus, tp=1, train={"micro_batch_size": 2}))[0]


def _assert_same_curve(got, ref):
    loss, norm = (torch.tensor([c[i] for c in got]) for i in (0, 1))
    ref_loss, ref_norm = (torch.tensor([c[i] for c in ref]) for i in (0, 1))
    assert_close(loss, ref_loss, "loss curve", tol=1e-5)
    assert_close(norm, ref_norm, "grad-norm curve", tol=1e-5)


def test_loss_falls_in_single_process(single):
    assert single[-1][0] < single[0][0] - 0.5


def test_tp2_follows_the_single_process_curve(ranks, corpus, single):
    results = ranks(2).run(losses_body, tiny_config(corpus, tp=2, train={"micro_batch_size": 2}))
    _assert_same_curve(results[0], single)
    assert results[0] == results[1], "tp ranks disagree on loss or grad norm"


def test_dp2_without_fsdp_follows_the_accumulated_curve(ranks, corpus, single):
    results = ranks(2).run(losses_body, tiny_config(corpus, tp=1, fsdp="off"))
    _assert_same_curve(results[0], single)


def test_dp2_with_fsdp_follows_the_accumulated_curve(ranks, corpus, single):
    results = ranks(2).run(losses_body, tiny_config(corpus, tp=1, fsdp="on"))
    _assert_same_curve(results[0], single)


def test_fused_adamw_clipping_inside_its_step_follows_the_same_curve(ranks, corpus, single):
    results = ranks(1).run(losses_body, tiny_config(corpus, tp=1, train={"micro_batch_size": 2, "fused_adam": "on"}))
    _assert_same_curve(results[0], single)


def test_clipping_is_active_in_these_runs(single):
    assert max(norm for _, norm in single) > 1.0, "grad norms never exceed clip=1: the tests would not cover clipping"


def resume_body(cfg, steps):
    """Resume from cfg.checkpoint.dir (if any), run `steps` steps, save; return the per-step losses."""
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    losses = [trainer._dp_mean(trainer.train_step()["loss"]) for _ in range(steps)]
    trainer.save()
    return trainer.step, losses


def test_resume_at_other_dp_continues_the_uninterrupted_curve(ranks, corpus, single, tmp_path):
    cfg = tiny_config(corpus, tp=1, fsdp="off", checkpoint={"dir": str(tmp_path / "ckpt")})
    first = ranks(2).run(resume_body, cfg, 3)[0]  # dp=2
    cfg.train.micro_batch_size = 2
    step, rest = ranks(1).run(resume_body, cfg, STEPS - 3)[0]  # dp=1, two micro-batches
    assert first[0] == 3 and step == STEPS
    got = torch.tensor(first[1] + rest)
    assert_close(got, torch.tensor([loss for loss, _ in single]), "loss curve across the dp change", tol=1e-5)


def run_body(cfg):
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    last = trainer.run()
    return trainer.step, last


def test_steps_0_resumes_evaluates_and_writes_nothing(ranks, corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    trained_to, trained = ranks(1).run(run_body, tiny_config(corpus, checkpoint={"dir": str(ckpt)}))[0]
    before = sorted((p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpt.iterdir())
    cfg = tiny_config(corpus, train={"steps": 0}, checkpoint={"dir": str(ckpt)})
    resumed_at, evaluated = ranks(1).run(run_body, cfg)[0]
    assert trained_to == resumed_at == STEPS
    assert evaluated == {"eval_loss": trained["eval_loss"]}, "the same weights give the same eval loss"
    assert sorted((p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpt.iterdir()) == before, \
        "no file or step directory was rewritten"


def optimizer_settings_body(cfg):
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    group = trainer.optimizer.param_groups[0]
    return trainer.changed_settings, group["weight_decay"], group["betas"], group["lr"] == trainer.schedule.lr


def test_a_resumed_run_takes_its_optimizer_settings_from_the_config(ranks, corpus, tmp_path):
    ckpt = {"dir": str(tmp_path / "ckpt")}
    ranks(1).run(run_body, tiny_config(corpus, checkpoint=ckpt, train={"weight_decay": 0.1}))
    cfg = tiny_config(corpus, checkpoint=ckpt, train={"steps": 8, "weight_decay": 0.3, "beta2": 0.9})
    changed, weight_decay, betas, lr_from_schedule = ranks(1).run(optimizer_settings_body, cfg)[0]
    assert (weight_decay, betas) == (0.3, (0.9, 0.9)), "the checkpoint's settings must not override the config"
    assert changed == ["weight_decay: 0.1 -> 0.3", "betas: (0.9, 0.95) -> (0.9, 0.9)"]
    assert lr_from_schedule, "the lr stays the schedule's at the resumed step"


def gpt_losses_body(cfg):
    """Like losses_body with tpflash's own GPT; also says whether its blocks were graphed."""
    trainer = Trainer(cfg)
    curve = [trainer._dp_mean(trainer.train_step()["loss"]) for _ in range(3)]
    graphed = trainer.model._graphed_blocks
    return curve, trainer.cuda_graphs, graphed is not None and graphed.main_grads is not None


def _gpt_config(corpus, cuda_graphs):
    return tiny_config(corpus, tp=2, cuda_graphs=cuda_graphs, train={"micro_batch_size": 2},
                       model={"preset": "gpt2-tiny", "n_layer": 2, "n_embd": 32, "sequence_parallel": True})


@pytest.mark.parametrize("world", [2, 4], ids=["dp1", "dp2"])
def test_cuda_graphs_on_trains_like_off(ranks, corpus, world):
    # on CPU the graphs are the eager stand-in: this checks the trainer's capture (after resume,
    # under its autocast, at the micro-batch shape), its accumulation over micro-batches, and at dp=2
    # (fsdp=auto replicates this model) the gradients' all-reduce over dp between replays
    # (2 micro-batches a step: at dp=1 the weight-gradient GEMMs add into main_grad; not under DDP)
    on, graphed, adds_in_gemms = ranks(world).run(gpt_losses_body, _gpt_config(corpus, "on"))[0]
    off, plain, _ = ranks(world).run(gpt_losses_body, _gpt_config(corpus, "off"))[0]
    assert graphed and not plain
    assert adds_in_gemms == (world == 2), "main_grad accumulation must be on at dp=1 and off under DDP"
    assert_close(torch.tensor(on), torch.tensor(off), "loss curve with cuda_graphs=on", tol=1e-6)


def test_cuda_graphs_auto_is_off_on_cpu_and_on_names_what_stands_in_the_way(corpus):
    from tpflash.models import GPT, GPTConfig
    from tpflash.train import build
    model = GPT(GPTConfig.preset("gpt2-tiny", n_layer=1, n_embd=32, dropout=0.1))
    cpu = torch.device("cpu")
    assert build.use_cuda_graphs(tiny_config(corpus, cuda_graphs="auto"), model, cpu, 1)[0] is False
    with pytest.raises(ValueError, match=r"cuda_graphs=on is not possible here: block 0 has dropout=0.1"):
        build.use_cuda_graphs(tiny_config(corpus, cuda_graphs="on"), model, cpu, 1)
    auto, why = build.use_cuda_graphs(tiny_config(corpus, cuda_graphs="auto"), model, torch.device("cuda"), 1)
    assert auto is False and "dropout=0.1" in why


@pytest.mark.parametrize("tp, dp, dp_mode, on", [(1, 1, "off", True), (1, 2, "off", False), (1, 2, "zero1", True),
                                                (2, 1, "off", True), (2, 4, "off", True), (2, 4, "zero1", True)])
def test_cuda_graphs_auto_graphs_on_cuda_except_tp1_replicated_by_ddp(corpus, tp, dp, dp_mode, on):
    # the rule only reads the device's type: no GPU needed to check it
    from tpflash.models import GPT, GPTConfig
    from tpflash.train import build
    model = GPT(GPTConfig.preset("gpt2-tiny", n_layer=1, n_embd=32))
    cfg = tiny_config(corpus, cuda_graphs="auto")
    cfg.tp = tp
    graphs, why = build.use_cuda_graphs(cfg, model, torch.device("cuda"), dp, dp_mode)
    assert graphs is on, why


class PoisonedTrainer(Trainer):
    """Sets one parameter to NaN on tp rank 0 before step `poison_at` (1-based), as a diverged run would."""

    poison_at = 4

    def train_step(self):
        if self.step + 1 == self.poison_at and self.ps.tp_rank == 0:
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return super().train_step()


def diverging_run_body(cfg):
    trainer = PoisonedTrainer(cfg, TinyConfig, TinyLM)
    try:
        trainer.run()
    except FloatingPointError as e:
        from tpflash import checkpoint
        return str(e), trainer.step, checkpoint.latest(cfg.checkpoint.dir)
    return None


def test_a_nonfinite_gradient_stops_every_rank_before_it_is_saved(ranks, corpus, tmp_path):
    # checkpoints every 2 steps, logs every 5: the NaN at step 4 is caught by step 4's save, not step 5's log
    cfg = tiny_config(corpus, tp=2, train={"micro_batch_size": 2}, log={"interval": 5},
                      checkpoint={"dir": str(tmp_path / "ckpt"), "interval": 2})
    results = ranks(2).run(diverging_run_body, cfg)
    assert results[0] is not None and results[0][:2] == results[1][:2], "both tp ranks must stop at the same step"
    message, stopped_at, latest = results[0]
    assert "the gradient norm was not finite at step 4 (now step 4)" in message
    assert "the newest checkpoint is step 2" in message
    assert stopped_at == 4 and latest is not None and os.path.basename(latest) == "step_2"


def test_a_nonfinite_gradient_stops_the_run_at_the_next_log_step_without_checkpoints(ranks, corpus):
    cfg = tiny_config(corpus, tp=1, log={"interval": 5})
    message, stopped_at, _ = ranks(1).run(diverging_run_body, cfg)[0]
    assert stopped_at == 5
    assert "not finite at step 4 (now step 5)" in message and "no checkpoint was written" in message
