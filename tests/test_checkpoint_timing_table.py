"""benchmarks/checkpoint_table.py: rates against the disk, and the async save's cost from step times."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import checkpoint_table  # noqa: E402


def _train(step, time):
    return {"kind": "train", "step": step, "time": time}


def test_steps_during_the_background_write_are_told_apart_from_the_others():
    rows = [_train(s, s * 1.0) for s in range(1, 11)]  # 1 s steps up to the save at step 10
    rows.append({"kind": "checkpoint", "step": 10, "time": 12.0, "staged_s": 2.0})
    t = 12.0
    for s in range(11, 21):  # step 11 holds the 2 s staging; 12-15 run at 1.5 s while the write runs
        t += 1.0 if s == 11 or s > 15 else 1.5
        rows.append(_train(s, t))
    rows.append({"kind": "checkpoint", "step": 10, "time": t, "write_s": 7.5, "GB": 1.0, "GB_per_s": 0.13})
    cost = checkpoint_table.async_cost(rows)
    assert cost["n_during"] == 4 and cost["during"] == pytest.approx(1.5)
    assert cost["outside"] == pytest.approx(1.0) and cost["interval"] == 10 and cost["staged_s"] == 2.0


def test_disk_rates_are_read_from_dd_lines_in_gb_per_s(tmp_path):
    (tmp_path / "disk.log").write_text(
        "disk write, 1 writer: 17179869184 bytes (17 GB, 16 GiB) copied, 8.5 s, 2.0 GB/s\n"
        "disk read, 1 reader: 17179869184 bytes (17 GB, 16 GiB) copied, 5 s, 3400 MB/s\n"
        "disk write, 4 writers: 2.75 GB/s\n")
    assert checkpoint_table.disk_rates(str(tmp_path / "disk.log")) == {"write 1": 2.0, "read 1": 3.4, "write 4": 2.75}


def test_the_table_lists_each_record_against_the_disk(tmp_path, capsys):
    (tmp_path / "disk.log").write_text("disk write, 4 writers: 2.00 GB/s\ndisk read, 1 reader: x, 4.0 GB/s\n")
    os.makedirs(tmp_path / "save")
    with open(tmp_path / "save" / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"kind": "checkpoint", "step": 3, "time": 1.0, "save_s": 60.0, "GB": 96.0,
                            "GB_per_s": 1.6}) + "\n")
    checkpoint_table.main(str(tmp_path))
    assert "| save: save, step 3 | 60.0 | 96.0 | 1.60 | 80% |  |" in capsys.readouterr().out
