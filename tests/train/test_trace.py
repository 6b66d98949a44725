"""`log.trace=START:END`: a torch.profiler chrome trace of exactly those steps, one file per rank."""
import contextlib
import io
import json
import os
import re

import pytest

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train.config import parse_args
from tpflash.train.loop import Trainer
from tpflash.train.trace import parse_trace_steps

pytestmark = pytest.mark.cpu_ranks


def test_trace_steps_are_read_as_an_inclusive_range():
    assert parse_trace_steps("20:22") == (20, 22)
    assert parse_trace_steps("7") == (7, 7)
    assert parse_trace_steps("") is None


@pytest.mark.parametrize("spec", ["0:2", "5:3", "a:b", "3:"])
def test_a_bad_trace_range_names_the_value_and_the_rule(spec):
    with pytest.raises(ValueError, match=re.escape(f"log.trace={spec!r} must be START:END with 1 <= START <= END")):
        parse_trace_steps(spec)


def test_a_trace_without_log_dir_is_refused_before_any_process_group(tmp_path):
    cfg = tiny_config(write_corpus(str(tmp_path)), log={"trace": "2:3"})
    with pytest.raises(ValueError, match="log.trace='2:3' needs log.dir"):
        Trainer(cfg, TinyConfig, TinyLM)  # no process group exists in this test process: it must raise first


def test_the_trace_option_is_a_config_key():
    assert parse_args(["--log.trace=4:6"]).log.trace == "4:6"


def traced_run_body(cfg):
    """Run the trainer; returns what rank 0 printed (the ranks are pooled processes: capfd misses them)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        Trainer(cfg, TinyConfig, TinyLM).run()
    return printed.getvalue()


def _step_marks(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    return sorted(n for n in names if n.startswith("train_step ")), names


def test_each_rank_writes_a_trace_of_exactly_the_chosen_steps(ranks, tmp_path):
    log_dir = tmp_path / "log"
    cfg = tiny_config(write_corpus(str(tmp_path)), tp=2, log={"dir": str(log_dir), "trace": "2:3"})
    ranks(2).run(traced_run_body, cfg)
    for rank in (0, 1):
        marks, names = _step_marks(log_dir / "trace" / f"rank{rank}.json")
        assert marks == ["train_step 2", "train_step 3"]
        assert any(n.startswith("aten::") for n in names), "the trace holds the steps' operators"
    assert not list((log_dir / "trace").glob("*.tmp")), "a trace is written under a temporary name, then renamed"


def test_a_run_that_ends_inside_the_range_still_writes_its_trace(ranks, tmp_path):
    log_dir = tmp_path / "log"
    cfg = tiny_config(write_corpus(str(tmp_path)), log={"dir": str(log_dir), "trace": "5:9"})  # the run has 6 steps
    printed = ranks(1).run(traced_run_body, cfg)[0]
    marks, _ = _step_marks(os.path.join(log_dir, "trace", "rank0.json"))
    assert marks == ["train_step 5", "train_step 6"]
    assert "trace of steps 5-6 written to" in printed


def test_a_range_the_run_never_reaches_is_reported(ranks, tmp_path):
    log_dir = tmp_path / "log"
    cfg = tiny_config(write_corpus(str(tmp_path)), log={"dir": str(log_dir), "trace": "20:22"})  # 6 steps
    printed = ranks(1).run(traced_run_body, cfg)[0]
    assert "log.trace=20:22: no step of that range ran; nothing was traced" in printed
    assert not (log_dir / "trace").exists()
