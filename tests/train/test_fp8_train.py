"""The trainer with fp8 GEMMs (--model.fp8): it trains at tp=2, and its checkpoint carries no fp8 state,
so a run resumes it with fp8 off (at another tp) and continues from the saved weights."""
import json

import pytest

from tests.train.test_resume_config import copy_of, corpus, gpt_config, steps_body  # noqa: F401 (fixture)

pytestmark = pytest.mark.cpu_ranks


@pytest.mark.parametrize("recipe,resumed_with", [("rowwise", "off"), ("delayed", "off"), ("off", "delayed")])
def test_an_fp8_checkpoint_resumes_with_fp8_changed_at_another_tp(ranks, corpus, tmp_path, recipe,  # noqa: F811
                                                                  resumed_with):
    """delayed: its amax histories are not saved; a resumed run records them afresh in its first step."""
    ckpt = str(tmp_path / "ckpt")
    cfg = gpt_config(corpus, ckpt, model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "fp8": recipe})
    cfg.tp = 2
    (start, losses, _), _ = ranks(2).run(steps_body, cfg, 4)
    assert start == 0 and losses[-1] < losses[0]
    resumed = gpt_config(corpus, ckpt, model={"fp8": resumed_with})
    start, more, _ = ranks(1).run(steps_body, resumed, 2)[0]
    assert start == 4
    assert abs(more[0] - losses[-1]) < 0.1 * losses[0]  # the saved weights, not a fresh model


@pytest.mark.parametrize("layout", ["fsdp_dp2_checkpointed", "cp2"])
def test_fp8_trains_under_fsdp_with_activation_checkpointing_and_under_cp(ranks, corpus, layout):  # noqa: F811
    model = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "fp8": "rowwise"}
    single = ranks(1).run(steps_body, gpt_config(corpus, model=model), 4)[0][1]
    cfg = gpt_config(corpus, model=dict(model, activation_checkpointing=layout.startswith("fsdp")))
    if layout.startswith("fsdp"):
        cfg.fsdp = "on"
    else:
        cfg.cp = 2
    losses = ranks(2).run(steps_body, cfg, 4)[0][1]
    assert losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, single)) < 0.05 * single[0]  # fp8 rounding apart


@pytest.mark.parametrize("where", ["command line", "yaml"])
def test_fp8_off_is_accepted_as_written(tmp_path, where):
    # YAML reads a bare `off` as false: the config must still mean the recipe "off"
    from tpflash.models import GPTConfig
    from tpflash.train.config import parse_args
    if where == "yaml":
        path = tmp_path / "c.yaml"
        path.write_text("model:\n  preset: llama-1b\n  fp8: off\n")
        cfg = parse_args(["--config", str(path)])
    else:
        cfg = parse_args(["--model.preset=llama-1b", "--model.fp8=off"])
    assert GPTConfig.preset("llama-1b", fp8=cfg.model["fp8"]).fp8 == "off"


def run_body(cfg, headroom):
    from tpflash.layers import fp8_history
    from tpflash.train.loop import Trainer
    kept, fp8_history.HEADROOM = fp8_history.HEADROOM, headroom
    try:
        Trainer(cfg).run()
    finally:
        fp8_history.HEADROOM = kept


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_a_delayed_run_logs_its_saturated_casts_by_operand_and_others_do_not(ranks, corpus, tmp_path,  # noqa: F811
                                                                             recipe):
    cfg = gpt_config(corpus, model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "fp8": recipe})
    cfg.log.dir = str(tmp_path)
    ranks(1).run(run_body, cfg, 1.0)  # no headroom: the tiny model's tensors, growing at lr 1e-2, clamp
    with open(tmp_path / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    keys = {"fp8_saturated_x", "fp8_saturated_w", "fp8_saturated_dy"}
    if recipe != "delayed":
        assert not any(keys & r.keys() for r in records)
        return
    assert len(records) == cfg.train.steps and all(keys <= r.keys() for r in records)
    counts = [r[k] for r in records for k in keys]
    # one log per step, four GEMMs (q/k/v, o, up/gate, down): at most four clamped casts per operand
    assert all(isinstance(n, int) and 0 <= n <= 4 for n in counts)
    assert sum(counts) > 0
    assert all(r[k] == 0 for r in records[:1] for k in keys), "the first step scales by its own amaxes"
