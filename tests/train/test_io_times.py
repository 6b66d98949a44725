"""The trainer logs how long its checkpoint saves, loads and exports take, with their size and rate
(records of kind "checkpoint" in metrics.jsonl)."""
import json
import os
import shutil
import threading
import time

import pytest

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.checkpoint.staging import PendingSave
from tpflash.checkpoint.directory import directory_bytes
from tpflash.train.io_times import SaveTimes
from tpflash.train.loop import Trainer

pytestmark = pytest.mark.cpu_ranks


def _files(directory, sizes):
    os.makedirs(directory, exist_ok=True)
    for i, size in enumerate(sizes):
        with open(os.path.join(directory, f"f{i}"), "wb") as f:
            f.write(b"x" * size)
    return str(directory)


def test_a_synchronous_save_is_reported_with_its_size_and_rate(tmp_path):
    path = _files(tmp_path / "step_3", [1000, 3000])
    parts = {"state": 0.1, "write": 1.5, "checksums": 0.3, "commit": 0.1}
    [(step, record)] = SaveTimes().saved(3, path, seconds=2.0, times=parts)
    assert step == 3 and record == pytest.approx({"save_s": 2.0, "GB": 4e-6, "GB_per_s": 2e-6, "state_s": 0.1,
                                                  "dcp_write_s": 1.5, "checksums_s": 0.3, "commit_s": 0.1})


def test_an_async_save_reports_its_staging_then_its_background_write_once_committed(tmp_path):
    path = _files(tmp_path / "step_4", [5000])
    release = threading.Event()
    pending = PendingSave(path)
    pending.start(release.wait)
    times, parts = SaveTimes(), {"state": 0.1, "staging": 0.4}
    assert times.saved(4, pending, seconds=0.5, times=parts) == [(4, {"staged_s": 0.5, "state_s": 0.1, "staging_s": 0.4})]
    assert times.finished() == [], "nothing to report while the write runs"
    parts.update(write=2.0, checksums=0.5, commit=0.2)  # as the background thread fills them in
    release.set()
    pending.wait()
    shutil.rmtree(path)  # pruned by a later save before the record is logged: its size was taken at commit
    [(step, record)] = times.finished()
    assert step == 4 and record["GB"] == 5e-6
    assert set(record) == {"write_s", "GB", "GB_per_s", "dcp_write_s", "checksums_s", "commit_s"}
    assert times.finished() == [], "reported once"


def test_directory_bytes_counts_nested_files_and_a_missing_directory_is_empty(tmp_path):
    _files(tmp_path / "a", [10])
    _files(tmp_path / "a" / "b", [20, 30])
    assert directory_bytes(str(tmp_path / "a")) == 60
    assert directory_bytes(str(tmp_path / "missing")) == 0


def run_body(cfg):
    Trainer(cfg, TinyConfig, TinyLM).run()


def _checkpoint_records(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "checkpoint"]


def test_the_trainer_logs_async_staging_background_writes_the_final_save_and_the_resume_load(ranks, tmp_path):
    corpus, ckpt, logs = write_corpus(str(tmp_path)), str(tmp_path / "ckpt"), str(tmp_path / "logs")
    cfg = tiny_config(corpus, tp=1, fsdp="off", log={"dir": logs},
                      checkpoint={"dir": ckpt, "interval": 2, "async_save": True, "keep": 0})
    ranks(2).run(run_body, cfg)
    cfg.train.steps = 8
    ranks(2).run(run_body, cfg)
    got = {(r["step"], k) for r in _checkpoint_records(logs) for k in r if k.endswith("_s")}
    assert {(2, "staged_s"), (2, "write_s"), (4, "staged_s"), (4, "write_s"), (6, "save_s")} <= got
    assert (6, "load_s") in got, "the resumed run's load"
    assert {(2, "staging_s"), (2, "dcp_write_s"), (6, "checksums_s"), (6, "commit_s")} <= got, "the parts"
    for r in _checkpoint_records(logs):
        if "GB" in r:
            size = directory_bytes(os.path.join(ckpt, f"step_{r['step']}"))
            assert r["GB"] == size / 1e9 and r["GB"] > 0


def slow_final_save_body(cfg):
    trainer = Trainer(cfg, TinyConfig, TinyLM)
    save = trainer.save

    def slow_save(final=True):
        time.sleep(1.5)
        save(final)

    trainer.save = slow_save
    trainer.run()


def test_the_run_summary_s_training_time_leaves_the_final_save_out(ranks, tmp_path):
    corpus, logs = write_corpus(str(tmp_path)), str(tmp_path / "logs")
    cfg = tiny_config(corpus, tp=1, log={"dir": logs}, checkpoint={"dir": str(tmp_path / "ckpt")})
    ranks(1).run(slow_final_save_body, cfg)
    with open(os.path.join(logs, "metrics.jsonl")) as f:
        (summary,) = [r for r in map(json.loads, f) if r["kind"] == "summary"]
    assert summary["time_s"] - summary["train_s"] >= 1.5, summary
