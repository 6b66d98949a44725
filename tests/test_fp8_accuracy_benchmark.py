"""benchmarks/fp8_accuracy.*: the config parses as the trainer's, and the table reads the runs right."""
import json
import os
import subprocess
import sys

from tpflash.train.config import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import fp8_accuracy_plot  # noqa: E402


def _write_run(runs_dir, mode, losses, eval_loss):
    os.makedirs(os.path.join(runs_dir, mode))
    with open(os.path.join(runs_dir, mode, "metrics.jsonl"), "w") as f:
        for i, loss in enumerate(losses):
            f.write(json.dumps({"kind": "train", "step": 10 * (i + 1), "loss": loss, "tokens_per_s": 100.0}) + "\n")
        f.write(json.dumps({"kind": "eval", "step": 10 * len(losses), "eval_loss": eval_loss}) + "\n")


def test_the_accuracy_config_is_a_valid_trainer_config_for_each_mode():
    for mode in ("off", "rowwise", "tensorwise", "delayed"):
        cfg = parse_args(["--config", os.path.join(ROOT, "benchmarks", "fp8_accuracy.yaml"), f"--model.fp8={mode}"])
        assert cfg.model["preset"] == "llama-1b" and cfg.model["fp8"] in (mode, False)  # YAML: off is false
        assert cfg.train.warmup_steps + cfg.train.decay_steps == cfg.train.steps == 1000


def test_the_table_compares_each_recipe_with_the_bf16_run(tmp_path):
    _write_run(str(tmp_path), "off", [5.0, 3.0, 2.0, 2.0], 2.5)
    _write_run(str(tmp_path), "rowwise", [5.0, 3.0, 2.02, 2.02], 2.55)
    text = fp8_accuracy_plot.table(fp8_accuracy_plot.read_runs(str(tmp_path)), tail=2)
    rowwise = next(line for line in text.splitlines() if line.startswith("| rowwise"))
    assert "| 2.0200 | +1.00% | 2.5500 | +2.00% |" in rowwise, text
    assert "| none |" in rowwise


def test_a_nan_loss_is_reported(tmp_path):
    _write_run(str(tmp_path), "off", [5.0, 3.0, 2.0], 2.5)
    _write_run(str(tmp_path), "tensorwise", [5.0, float("nan"), 2.0], 2.5)
    text = fp8_accuracy_plot.table(fp8_accuracy_plot.read_runs(str(tmp_path)), tail=1)
    assert "| yes |" in next(line for line in text.splitlines() if line.startswith("| tensorwise")), text


def test_no_runs_is_one_clear_message(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fp8_accuracy_plot.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no ('off', 'rowwise', 'tensorwise', 'delayed') runs" in proc.stderr, proc.stderr


def test_the_mean_table_averages_each_mode_over_the_seeds_and_shows_each_seeds_gap(tmp_path):
    for seed, (bf16_eval, fp8_eval) in {"seed1": (2.0, 2.1), "seed2": (2.2, 2.09)}.items():
        _write_run(str(tmp_path / seed), "off", [5.0, 2.0], bf16_eval)
        _write_run(str(tmp_path / seed), "tensorwise", [5.0, 2.0], fp8_eval)
    runs = {str(tmp_path / seed): fp8_accuracy_plot.read_runs(str(tmp_path / seed)) for seed in ("seed1", "seed2")}
    text = fp8_accuracy_plot.mean_table(runs, tail=1)
    row = next(line for line in text.splitlines() if line.startswith("| tensorwise"))
    assert "| 2.0950 | -0.24% | +5.00%, -5.00% |" in row, text  # mean 2.095 against 2.1; each seed +5% / -5%
    assert "(seed1, seed2)" in text.splitlines()[0], text
