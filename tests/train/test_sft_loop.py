"""The trainer on jsonl data: the loss is the mean over the global batch's loss-carrying tokens, so
dp=2 (uneven token counts per rank) follows dp=1, and a resume at another dp continues exactly."""
import math

import pytest
import torch

from tests.distributed.checks import assert_close
from tests.train.sft_common import PackedTinyLM, arithmetic_records, sft_config, write_jsonl
from tests.train.tiny_model import TinyConfig
from tpflash.train import build
from tpflash.train.loop import Trainer
from tpflash.train.packing import forward_kwargs

pytestmark = pytest.mark.cpu_ranks  # fp32 curves of several world sizes: gloo on CPU

STEPS = 5
GPT_MODEL = {"preset": "gpt2-tiny", "n_layer": 2, "n_head": 2, "n_embd": 32}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(str(tmp_path_factory.mktemp("sft") / "train.jsonl"), arithmetic_records(80))


def _trainer(cfg, stand_in):
    return Trainer(cfg, TinyConfig, PackedTinyLM) if stand_in else Trainer(cfg)


def curve_body(cfg, stand_in=True, steps=STEPS):
    """Per-step (global loss, grad norm), per-step loss tokens of each dp rank, and the eval loss."""
    trainer = _trainer(cfg, stand_in)
    ps, plan = trainer.ps, trainer.plan
    curve, counts = [], []
    for _ in range(steps):
        counts.append([trainer.train_data.loss_tokens(trainer.sampler.rank_slice(plan.batch_size, d, ps.dp_size))
                       for d in range(ps.dp_size)])
        out = trainer.train_step()
        curve.append((trainer._dp_mean(out["loss"]), out["grad_norm"].item()))
    return curve, counts, trainer.evaluate()


def _assert_same_curve(got, ref, what):
    for i, name in enumerate(("loss", "grad-norm")):
        assert_close(torch.tensor([c[i] for c in got]), torch.tensor([c[i] for c in ref]), f"{what}: {name} curve",
                     tol=1e-5)


@pytest.fixture(scope="module")
def single(ranks, data):
    return ranks(1).run(curve_body, sft_config(data, train={"micro_batch_size": 1}))[0]  # 4 micro-batches


def first_step_body(cfg):
    """(the step's loss and grad norm, those of one forward over the global batch: summed loss / its
    loss tokens, and the mean of the micro-batches' mean losses, which is not what is wanted)."""
    trainer = Trainer(cfg, TinyConfig, PackedTinyLM)
    rows = trainer.sampler.indices(0, cfg.train.batch_size)
    reference = PackedTinyLM(trainer.model_config)  # a copy of the trainer's model, outside the trainer
    reference.load_state_dict(trainer.model.state_dict())
    batch = trainer.train_data.batch(rows)
    loss = reference(batch.inputs, batch.targets, **forward_kwargs(batch, lambda t: t))
    (loss / trainer.train_data.loss_tokens(rows)).backward()
    norm = math.sqrt(sum(float(p.grad.square().sum()) for p in reference.parameters()))
    with torch.no_grad():
        means = []
        for row in rows:
            one = trainer.train_data.batch([row])
            means.append(reference(one.inputs, one.targets, **{**forward_kwargs(one, lambda t: t), "reduction": "mean"}))
    out = trainer.train_step()
    return (out["loss"].item(), out["grad_norm"].item()), (loss.item() / trainer.train_data.loss_tokens(rows), norm), \
        float(sum(means) / len(means))


def test_a_step_takes_the_mean_over_the_global_batch_tokens(ranks, data):
    step, reference, mean_of_means = ranks(1).run(first_step_body, sft_config(data, train={"micro_batch_size": 1}))[0]
    assert step == pytest.approx(reference, rel=1e-5)
    assert abs(mean_of_means - reference[0]) > 1e-3, "rows of uneven token counts: the two means should differ"


@pytest.mark.parametrize("fsdp, micro", [("off", 1), ("on", 2)], ids=["ddp-accum2", "fsdp"])
def test_dp2_with_uneven_tokens_per_rank_follows_dp1(ranks, data, single, fsdp, micro):
    curve, counts, eval_loss = ranks(2).run(curve_body, sft_config(data, fsdp=fsdp, train={"micro_batch_size": micro}))[0]
    assert sum(a != b for a, b in counts) >= 3, f"the ranks' loss tokens per step {counts} should be uneven"
    _assert_same_curve(curve, single[0], f"dp=2 fsdp={fsdp}")
    assert eval_loss == pytest.approx(single[2], rel=1e-5)


def test_the_loss_falls(single):
    assert single[0][-1][0] < single[0][0][0] - 0.5


def resume_body(cfg, steps):
    trainer = Trainer(cfg, TinyConfig, PackedTinyLM)
    losses = [trainer._dp_mean(trainer.train_step()["loss"]) for _ in range(steps)]
    trainer.save()
    return trainer.step, trainer.sampler.consumed, losses


def test_resume_at_another_dp_continues_at_the_exact_row(ranks, data, single, tmp_path):
    cfg = sft_config(data, fsdp="off", checkpoint={"dir": str(tmp_path / "ckpt")})
    step, consumed, first = ranks(2).run(resume_body, cfg, 3)[0]  # dp=2
    assert (step, consumed) == (3, 12)
    cfg.train.micro_batch_size = 1
    step, consumed, rest = ranks(1).run(resume_body, cfg, STEPS - 3)[0]  # dp=1, four micro-batches
    assert (step, consumed) == (STEPS, 4 * STEPS)
    assert_close(torch.tensor(first + rest), torch.tensor([loss for loss, _ in single[0]]),
                 "loss curve across the dp change", tol=1e-5)


def test_gpt_at_dp2_follows_dp1_on_packed_rows(ranks, data):
    ref = ranks(1).run(curve_body, sft_config(data, model=GPT_MODEL, train={"micro_batch_size": 1}), False, 3)[0]
    got = ranks(2).run(curve_body, sft_config(data, model=GPT_MODEL, fsdp="off"), False, 3)[0]
    _assert_same_curve(got[0], ref[0], "GPT dp=2")
    assert got[2] == pytest.approx(ref[2], rel=1e-5)


def test_gpt_at_tp2_with_sequence_parallelism_follows_tp1_on_packed_rows(ranks, data):
    ref = ranks(1).run(curve_body, sft_config(data, model=GPT_MODEL), False, 3)[0]
    got = ranks(2).run(curve_body, sft_config(data, tp=2, model={**GPT_MODEL, "sequence_parallel": True}), False, 3)[0]
    _assert_same_curve(got[0], ref[0], "GPT tp=2 SP")


def test_packed_data_runs_eager(data):
    from tpflash.models import GPT, GPTConfig
    model = GPT(GPTConfig.preset("gpt2-tiny", n_layer=1, n_embd=32))
    assert build.use_cuda_graphs(sft_config(data, tp=2), model, torch.device("cuda"), 1) == \
        (False, "auto: off (packed documents)")
    with pytest.raises(ValueError, match="cuda_graphs=on is not possible with data.format=jsonl: packed documents"):
        build.use_cuda_graphs(sft_config(data, cuda_graphs="on"), model, torch.device("cuda"), 1)


def test_cuda_graphs_on_with_jsonl_is_refused_before_any_process_group(data):
    with pytest.raises(ValueError, match="cuda_graphs=on is not possible with data.format=jsonl"):
        Trainer(sft_config(data, cuda_graphs="on"), TinyConfig, PackedTinyLM)


def test_a_bad_line_stops_the_trainer_naming_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2="\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        Trainer(sft_config(str(path)), TinyConfig, PackedTinyLM)
