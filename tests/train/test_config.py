"""TrainConfig: YAML + command-line overrides, type conversion, and clear errors."""
import glob
import re
import os

import pytest

from tpflash.train.build import plan_batches
from tpflash.train.config import TrainConfig, TrainSection, check_values, load_yaml, parse_args, resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dotted_and_bare_overrides_set_typed_values():
    cfg = parse_args(["--tp", "2", "--train.lr=3e-4", "--steps=1e3", "--model.n_layer=4", "--data.exclude=a,b"])
    assert cfg.tp == 2 and cfg.train.lr == 3e-4 and cfg.train.steps == 1000
    assert cfg.model == {"n_layer": 4} and cfg.data.exclude == ["a", "b"]


def test_yaml_is_read_then_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("tp: 2\nfsdp: on\nmodel: {preset: gpt2-small}\ntrain: {lr: 1.0e-3, steps: 7}\n")
    cfg = parse_args(["--config", str(path), "--train.steps=9"])
    assert (cfg.tp, cfg.fsdp, cfg.model["preset"], cfg.train.lr, cfg.train.steps) == (2, "on", "gpt2-small", 1e-3, 9)


@pytest.mark.parametrize("args, message", [
    (["--lrr=1"], "unknown config key 'lrr' (did you mean train.lr?)"),
    (["--dir=x"], "ambiguous: write one of checkpoint.dir, log.dir"),
    (["--train.steps=ten"], "cannot read 'ten' as int"),
    (["--dtype=fp8"], "'fp8' is not one of auto, bf16, fp32"),
    (["--gemm_workspace=small"], "'small' is not one of auto, default, none"),
    (["--tp"], "--tp needs a value"),
    (["positional"], "unexpected argument 'positional'"),
])
def test_bad_command_line_names_the_key(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(args)


@pytest.mark.parametrize("args, message", [
    (["--train.lr=-1"], "'train.lr': -1.0 must be > 0"),
    (["--train.steps=-3"], "'train.steps': -3 must be >= 0"),
    (["--train.beta2=1.5"], "'train.beta2': 1.5 must be in [0, 1)"),
    (["--log.interval=0"], "'log.interval': 0 must be >= 1"),
    (["--checkpoint.keep=-1"], "'checkpoint.keep': -1 must be >= 0"),
])
def test_values_outside_their_range_name_the_key_and_the_rule(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(args)


def test_configs_built_in_code_are_checked_too():
    cfg = TrainConfig()
    check_values(cfg)  # the defaults are valid
    cfg.train.clip = -1.0
    with pytest.raises(ValueError, match=re.escape("'train.clip': -1.0 must be >= 0")):
        check_values(cfg)


def test_unknown_yaml_key_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {learning_rate: 1}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown config key 'train.learning_rate'"):
        load_yaml(str(path))


def test_batch_plan_derives_accumulation_and_rejects_mismatch():
    plan = plan_batches(TrainSection(batch_size=16, micro_batch_size=2), dp=2)
    assert (plan.micro, plan.grad_accum, plan.per_rank) == (2, 4, 8)
    with pytest.raises(ValueError, match="batch_size=6 must be a positive multiple of dp=4"):
        plan_batches(TrainSection(batch_size=6), dp=4)
    with pytest.raises(ValueError, match="grad_accum=3 but batch_size=16"):
        plan_batches(TrainSection(batch_size=16, micro_batch_size=2, grad_accum=3), dp=2)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "tpflash", "configs", "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_shipped_configs_load(path):
    assert isinstance(load_yaml(path), TrainConfig)


def test_config_names_resolve_to_the_packaged_files_and_paths_still_work(tmp_path):
    assert resolve_config("demo") == os.path.join(ROOT, "tpflash", "configs", "demo.yaml")
    assert resolve_config("demo.yaml") == resolve_config("demo")
    assert parse_args(["--config", "demo"]).model["n_layer"] == 4
    path = tmp_path / "mine.yaml"
    path.write_text("tp: 3\n")
    assert parse_args(["--config", str(path)]).tp == 3


def test_an_unknown_config_name_lists_the_packaged_ones():
    with pytest.raises(ValueError, match=r"--config 'nope': no such file, and not a packaged config "
                                         r"\(packaged: demo, .*llama-style\)"):
        parse_args(["--config", "nope"])
    with pytest.raises(ValueError, match="no such file"):
        parse_args(["--config", "missing/demo.yaml"])


def test_cli_prints_the_resolved_config_and_rejects_bad_keys(capsys):
    from tpflash.train.cli import main
    assert main(["--config", "demo", "--tp=1", "--print-config"]) == 0
    assert "tp: 1\n" in capsys.readouterr().out
    assert main(["--lrr=1"]) == 2
    assert "unknown config key 'lrr'" in capsys.readouterr().err
