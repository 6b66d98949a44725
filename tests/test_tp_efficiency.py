"""benchmarks/tp_efficiency.py: each tp=N launch set against the mean of its own GPUs' tp=1."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
from tp_efficiency import comparison, efficiencies, load, table  # noqa: E402


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


def test_the_table_adds_the_efficiency_of_steps_issued_one_ahead_where_every_row_has_it(tmp_path):
    """Steps issued one ahead (as the trainer runs them) move the same tokens in ahead_ms instead of step_ms."""
    for gpu in (0, 1):
        _write(str(tmp_path), f"tp1_gpus{gpu}-{gpu}.jsonl",
               [{"model": "m", "tp": 1, "tok_s_gpu": 100.0, "step_ms": 200.0, "ahead_ms": 200.0}])
    _write(str(tmp_path), "tp2_gpus0-1.jsonl", [{"model": "m", "tp": 2, "tok_s_gpu": 80.0, "step_ms": 125.0,
                                                 "ahead_ms": 120.0}])
    text = table(load(str(tmp_path)))
    assert "| 2 | 0-1 | 80 | 0.800 | 83 | 0.833 |" in text


def test_the_table_leaves_out_the_steps_one_ahead_where_a_row_lacks_them(tmp_path):
    _results(str(tmp_path))
    assert "one step ahead" not in table(load(str(tmp_path)))


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


def _timed(directory, step_ms):
    """One tree's launches of model m on 2 GPUs, each launch's step ms from `step_ms`."""
    os.makedirs(directory, exist_ok=True)
    for gpu in (0, 1):
        _write(directory, f"tp1_gpus{gpu}-{gpu}.jsonl", [{"model": "m", "tp": 1, "tok_s_gpu": 100.0, "step_ms": 200.0}])
    for name, ms in zip(("tp2_gpus0-1.jsonl", "tp2_gpus0-1_b.jsonl"), step_ms):
        _write(directory, name, [{"model": "m", "tp": 2, "tok_s_gpu": 90.0, "step_ms": ms}])


def test_a_comparison_sets_each_layouts_step_time_against_the_other_trees(tmp_path):
    _timed(str(tmp_path / "this1"), [99.0, 101.0])
    _timed(str(tmp_path / "this2"), [98.0, 98.0])
    _timed(str(tmp_path / "against"), [100.0, 104.0])
    text = comparison([load(str(tmp_path / d)) for d in ("this1", "this2")], load(str(tmp_path / "against")),
                      ["this1", "this2"])
    assert "| m | 2 | 0-1 | 99.00, 101.00 | 98.00, 98.00 | 100.00, 104.00 | -2.9% |" in text  # 99 / 102 - 1
    assert "| m | 1 | 1-1 | 200.00 | 200.00 | 200.00 | +0.0% |" in text


def test_a_comparison_refuses_a_layout_one_tree_lacks(tmp_path):
    _timed(str(tmp_path / "this1"), [99.0])
    _timed(str(tmp_path / "against"), [100.0])
    os.remove(tmp_path / "this1" / "tp1_gpus1-1.jsonl")
    with pytest.raises(ValueError, match="in the tree measured against only"):
        comparison([load(str(tmp_path / "this1"))], load(str(tmp_path / "against")), ["this1"])


_FAKE_PYTHON = r"""#!/usr/bin/env bash
# a stand-in python3: a torchrun launch of bench_e2e records where it ran and writes a row (the tree
# measured against is 5% slower); anything else runs the real interpreter
if [ "$1" = "-m" ] && [ "$2" = "torch.distributed.run" ]; then
  while [ $# -gt 0 ]; do case "$1" in --tp) tp=$2;; --results) out=$2;; esac; shift; done
  echo "$PWD tp=$tp" >> "$LAUNCH_LOG"
  ms=100; [ -f SLOWER ] && ms=105
  echo "{\"model\": \"m\", \"tp\": $tp, \"tok_s_gpu\": $(( 10000 / ms )), \"step_ms\": $ms}" > "$out"
  exit 0
fi
exec REAL "$@"
"""


def _run_launcher(tmp_path, **env_extra):
    """tp_efficiency.sh on 2 fake GPUs at TPS=2 with the stand-in python3: (its stdout, the tree of
    each launch in order)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(_FAKE_PYTHON.replace("REAL", sys.executable))
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho GPU 0; echo GPU 1\n")
    for tool in ("python3", "nvidia-smi"):
        os.chmod(bin_dir / tool, 0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), TPS="2",
               LAUNCH_LOG=str(tmp_path / "launches.txt"), **env_extra)
    done = subprocess.run(["bash", os.path.join(BENCH, "tp_efficiency.sh")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, [line.split()[0] for line in (tmp_path / "launches.txt").read_text().splitlines()]


def test_the_launcher_writes_one_table_of_this_tree(tmp_path):
    out, trees = _run_launcher(tmp_path)
    assert trees == [os.path.dirname(BENCH)] * 4, trees  # tp=2, tp=1 on each GPU, tp=2 again
    assert "| 2 | 0-1 | 100 | 1.000 |" in out and (tmp_path / "out" / "tp2_gpus0-1_b.jsonl").exists()


def test_the_launcher_runs_this_tree_around_the_other_one(tmp_path):
    """AGAINST=<tree>: the launches with this tree, then with that one, then with this one again, each
    in a directory of its own, then the tables and the step times against that tree."""
    other = tmp_path / "other"
    (other / "benchmarks").mkdir(parents=True)
    (other / "benchmarks" / "bench_e2e.py").write_text("")
    (other / "SLOWER").write_text("")
    out, trees = _run_launcher(tmp_path, AGAINST=str(other))
    repo = os.path.dirname(BENCH)
    assert trees == [repo] * 4 + [str(other)] * 4 + [repo] * 4, trees
    for run in ("this1", "against", "this2"):
        assert (tmp_path / "out" / run / "tp2_gpus0-1_b.jsonl").exists(), run
    assert "| m | 2 | 0-1 | 100.00, 100.00 | 100.00, 100.00 | 105.00, 105.00 | -4.8% |" in out
