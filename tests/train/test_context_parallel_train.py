"""The trainer under context parallelism, with tpflash's GPT on CPU ranks in fp32: cp=2 (DDP, FSDP or zero3 over
the cp ranks), (cp=2, tp=2) and cp_comm=allgather follow the single-process curve; a checkpoint saved at
one cp resumes at another and continues that curve; bad cp settings are one clear ValueError before
any process group; the layout line names cp."""
import pytest
import torch

from tests.distributed.checks import assert_close
from tests.train.common import tiny_config, write_corpus
from tests.train.sft_common import arithmetic_records, sft_config, write_jsonl
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train import build
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks

STEPS = 20
MODEL = {"preset": "llama-tiny", "n_layer": 2, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "ffn_hidden": 64,
         "block_size": 16}


def gpt_config(corpus, tp=1, cp=1, **overrides):
    """A 20-step fp32 run of a tiny llama-style GPT on 16-token windows, 4 sequences a step."""
    model = {**MODEL, **overrides.pop("model", {})}
    train = {"steps": STEPS, **overrides.pop("train", {})}
    data = overrides.pop("data", {})
    cfg = tiny_config(corpus, tp=tp, cp=cp, dtype="fp32", model=model, train=train, **overrides)
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def curve_body(cfg, steps=STEPS):
    """(per-step (loss averaged over dp, global grad norm), every layout line describe prints)."""
    trainer = Trainer(cfg)
    curve = []
    for _ in range(steps):
        out = trainer.train_step()
        curve.append((trainer._dp_mean(out["loss"]), out["grad_norm"].item()))
    notes = []
    trainer.describe(type("Notes", (), {"note": staticmethod(notes.append)})())
    return curve, notes


def resume_body(cfg, steps):
    """Resume from cfg.checkpoint.dir (if any), run `steps` steps, save; (step reached, per-step curve)."""
    trainer = Trainer(cfg)
    curve = []
    for _ in range(steps):
        out = trainer.train_step()
        curve.append((trainer._dp_mean(out["loss"]), out["grad_norm"].item()))
    trainer.save()
    return trainer.step, curve


def error_body(cfg, model_cls=None):
    """The ValueError Trainer(cfg) raises (None if it builds)."""
    try:
        Trainer(cfg, TinyConfig if model_cls else None, model_cls)
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
def single(ranks, corpus):
    return ranks(1).run(curve_body, gpt_config(corpus))[0][0]


def _assert_same_curve(got, ref, what=""):
    loss, norm = (torch.tensor([c[i] for c in got]) for i in (0, 1))
    ref_loss, ref_norm = (torch.tensor([c[i] for c in ref]) for i in (0, 1))
    assert_close(loss, ref_loss, f"loss curve{what}", tol=1e-5)
    assert_close(norm, ref_norm, f"grad-norm curve{what}", tol=1e-5)


def _assert_ranks_agree(results):
    curves = [curve for curve, _ in results]
    assert all(c == curves[0] for c in curves), "ranks disagree on loss or grad norm"


def test_the_single_process_curve_learns_and_clips(single):
    assert single[-1][0] < single[0][0] - 0.5
    assert max(norm for _, norm in single) > 1.0, "grad norms never exceed clip=1: clipping would go untested"


@pytest.mark.parametrize("fsdp", ["off", "on", "zero3"], ids=["ddp", "fsdp", "zero3"])
def test_cp2_follows_the_single_process_curve(ranks, corpus, single, fsdp):
    results = ranks(2).run(curve_body, gpt_config(corpus, cp=2, fsdp=fsdp))
    _assert_same_curve(results[0][0], single)
    _assert_ranks_agree(results)


def test_the_layout_line_names_cp_and_its_communication(ranks, corpus):
    notes = ranks(2).run(curve_body, gpt_config(corpus, cp=2, fsdp="off", cp_comm="allgather"), 0)[0][1]
    assert notes[0].startswith("layout: tp=1 cp=2 (allgather) dp=1 (world 2, cpu), fsdp=off"), notes[0]
    assert "cuda graphs auto: off (cp=2)" in notes[0]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_cp2_tp2_follows_the_single_process_curve(ranks, corpus, single, sequence_parallel):
    cfg = gpt_config(corpus, tp=2, cp=2, model={"sequence_parallel": sequence_parallel})
    results = ranks(4).run(curve_body, cfg)
    _assert_same_curve(results[0][0], single)
    _assert_ranks_agree(results)


def test_cp2_allgather_follows_the_single_process_curve(ranks, corpus, single):
    results = ranks(2).run(curve_body, gpt_config(corpus, cp=2, cp_comm="allgather"))
    _assert_same_curve(results[0][0], single)
    _assert_ranks_agree(results)


def test_a_cp2_tp2_checkpoint_resumes_in_one_process_on_the_same_curve(ranks, corpus, single, tmp_path):
    ckpt = {"dir": str(tmp_path / "ckpt"), "interval": 10}
    results = ranks(4).run(resume_body, gpt_config(corpus, tp=2, cp=2, checkpoint=ckpt), 10)
    step, first = results[0]
    resumed_at, rest = ranks(1).run(resume_body, gpt_config(corpus, checkpoint=ckpt), STEPS - 10)[0]
    assert step == 10 and resumed_at == STEPS
    _assert_same_curve(first + rest, single, " across cp=2 tp=2 -> cp=1 tp=1")


def test_a_single_process_checkpoint_resumes_at_cp2_on_the_same_curve(ranks, corpus, single, tmp_path):
    ckpt = {"dir": str(tmp_path / "ckpt"), "interval": 10}
    step, first = ranks(1).run(resume_body, gpt_config(corpus, checkpoint=ckpt), 10)[0]
    results = ranks(2).run(resume_body, gpt_config(corpus, cp=2, fsdp="on", checkpoint=ckpt), STEPS - 10)
    resumed_at, rest = results[0]
    assert step == 10 and resumed_at == STEPS
    _assert_same_curve(first + rest, single, " across cp=1 -> cp=2 (fsdp)")


# ---------------------------------------------------------------- bad settings

def _check(cfg, model_cls=None, seq_len=16, packed=False):
    """build.check_context_parallel on cfg with GPT's config (or TinyConfig for TinyLM)."""
    from tpflash.models import GPT, GPTConfig
    if model_cls is None:
        model_config = build.resolve_model_config(cfg.model, 256, GPTConfig)
        model_cls = GPT
    else:
        model_config = TinyConfig()
    build.check_context_parallel(cfg, model_config, seq_len, packed, model_cls)


def test_cp_with_packed_jsonl_rows_is_refused_on_every_rank(ranks, tmp_path):
    data = write_jsonl(str(tmp_path / "train.jsonl"), arithmetic_records())
    cfg = sft_config(data, cp=2, model={**MODEL, "block_size": 32})
    messages = ranks(2).run(error_body, cfg)
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert messages[0].startswith("cp=2 needs unpacked rows: data.format=jsonl"), messages[0]


def test_cp_that_does_not_divide_the_world_is_refused(corpus):
    from tpflash import parallel
    with pytest.raises(ValueError, match=r"^world size 2 is not divisible by tp=1 \* cp=3 = 3$"):
        parallel.check_layout(2, 1, -1, 3)
    with pytest.raises(ValueError, match=r"^dp=2 \* cp=2 \* tp=1 = 4 does not equal the world size 2$"):
        parallel.check_layout(2, 1, 2, 2)


def test_sequences_that_do_not_split_into_2cp_chunks_are_refused(corpus):
    with pytest.raises(ValueError, match="12"):
        _check(gpt_config(corpus, cp=4, data={"seq_len": 12}), seq_len=12)
    _check(gpt_config(corpus, cp=2, data={"seq_len": 12}), seq_len=12)  # 12 = 3 chunks of 2 * cp


def test_sequence_parallel_needs_each_cp_share_divisible_by_tp(corpus):
    cfg = gpt_config(corpus, tp=4, cp=2, data={"seq_len": 12}, model={"sequence_parallel": True})
    with pytest.raises(ValueError, match=r"sequence length 12 gives each of cp=2 ranks 6 tokens, which is not "
                                         r"divisible by tp=4"):
        _check(cfg, seq_len=12)


def test_cuda_graphs_on_at_cp2_is_refused(corpus):
    from tpflash.models import GPT, GPTConfig
    cfg = gpt_config(corpus, cp=2, cuda_graphs="on")
    with pytest.raises(ValueError, match=r"^cuda_graphs=on is not possible with cp=2"):
        _check(cfg)  # before any process group
    model = GPT(GPTConfig.preset("llama-tiny", n_layer=1, n_embd=32, n_head=4, n_kv_head=2, ffn_hidden=64))
    with pytest.raises(ValueError, match=r"^cuda_graphs=on is not possible with cp=2"):
        build.use_cuda_graphs(cfg, model, torch.device("cuda"), 1)


def test_sampling_at_cp2_is_refused(corpus):
    with pytest.raises(ValueError, match=r"^log.sample_tokens=8 samples without context parallelism"):
        _check(gpt_config(corpus, cp=2, log={"sample_tokens": 8}))


def test_a_model_class_without_cp_comm_is_refused(corpus):
    with pytest.raises(ValueError, match=r"^cp=2: TinyLM does not take cp_comm="):
        _check(tiny_config(corpus, cp=2), model_cls=TinyLM)


def test_cp1_accepts_what_cp2_refuses(corpus):
    _check(gpt_config(corpus, log={"sample_tokens": 8}, cuda_graphs="on"), model_cls=TinyLM, packed=True, seq_len=7)


def test_a_model_class_without_cp_comm_is_refused_by_every_rank_of_the_trainer(ranks, corpus):
    messages = ranks(2).run(error_body, tiny_config(corpus, cp=2), TinyLM)
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert messages[0].startswith("cp=2: TinyLM does not take cp_comm="), messages[0]
