"""benchmarks/tp_efficiency.py: each tp=N launch set against the mean of its own GPUs' tp=1."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
from tp_efficiency import efficiencies, load, table  # noqa: E402


def _write(directory, name, rows):
    with open(os.path.join(directory, name), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _results(directory):
    """4 GPUs, GPU 1 the slowest at tp=1; tp=2 on both pairs, tp=4 twice."""
    for gpu, speed in enumerate([100.0, 96.0, 99.0, 101.0]):
        _write(directory, f"tp1_gpus{gpu}-{gpu}.jsonl", [{"model": "m", "tp": 1, "tok_s_gpu": speed}])
    _write(directory, "tp2_gpus0-1.jsonl", [{"model": "m", "tp": 2, "tok_s_gpu": 88.0}])
    _write(directory, "tp2_gpus2-3.jsonl", [{"model": "m", "tp": 2, "tok_s_gpu": 90.0}])
    _write(directory, "tp4_gpus0-3.jsonl", [{"model": "m", "tp": 4, "tok_s_gpu": 79.0}])
    _write(directory, "tp4_gpus0-3_b.jsonl", [{"model": "m", "tp": 4, "tok_s_gpu": 80.0}])
    _write(directory, "notes.txt", [])  # other files are left alone


def test_each_launch_is_set_against_the_mean_of_its_own_gpus_tp1(tmp_path):
    _results(str(tmp_path))
    tp1, launches = efficiencies(load(str(tmp_path)), "m")
    assert tp1 == {0: 100.0, 1: 96.0, 2: 99.0, 3: 101.0}
    assert [(tp, gpus) for tp, gpus, _, _ in launches] == [(2, (0, 1)), (2, (2, 3)), (4, (0, 3)), (4, (0, 3))]
    effs = [eff for _, _, _, eff in launches]
    assert effs == pytest.approx([88.0 / 98.0, 90.0 / 100.0, 79.0 / 99.0, 80.0 / 99.0])


def test_the_table_lists_every_gpus_tp1_and_every_launch(tmp_path):
    _results(str(tmp_path))
    text = table(load(str(tmp_path)))
    assert "0: 100, 1: 96, 2: 99, 3: 101" in text
    assert "| 2 | 0-1 | 88 | 0.898 |" in text and "| 4 | 0-3 | 80 | 0.808 |" in text


def test_a_launch_without_its_gpus_tp1_is_refused(tmp_path):
    _results(str(tmp_path))
    os.remove(tmp_path / "tp1_gpus3-3.jsonl")
    with pytest.raises(ValueError, match=r"no tp=1 row for GPU \[3\]"):
        efficiencies(load(str(tmp_path)), "m")


def test_a_failed_row_is_refused_rather_than_counted(tmp_path):
    _results(str(tmp_path))
    _write(str(tmp_path), "tp2_gpus2-3.jsonl", [{"model": "m", "tp": 2, "error": "OOM"}])
    with pytest.raises(ValueError, match="OOM"):
        efficiencies(load(str(tmp_path)), "m")


def test_a_file_whose_gpus_do_not_match_its_tp_is_refused(tmp_path):
    _write(str(tmp_path), "tp4_gpus0-1.jsonl", [{"model": "m", "tp": 4, "tok_s_gpu": 1.0}])
    with pytest.raises(ValueError, match="2 GPUs"):
        load(str(tmp_path))


def test_the_launcher_script_parses():
    subprocess.run(["bash", "-n", os.path.join(BENCH, "tp_efficiency.sh")], check=True)
