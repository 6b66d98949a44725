"""Configuration and input errors under torchrun: one `error:` line per job, non-zero exit on every
rank; --debug (or TPFLASH_DEBUG=1) shows the traceback instead."""
import os
import subprocess
import sys

import pytest

from tests.train.common import write_corpus
from tests.train.elastic import ROOT, TINY_GPT, env
from tpflash.train import cli

TP_MISMATCH = "world size 2 is not divisible by tp=3"


def _torchrun(tmp_path, *args, **extra_env):
    corpus = write_corpus(str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.2", "-m", "tpflash.train", f"--data.path={corpus}",
           f"--checkpoint.dir={tmp_path}/ckpt", f"--log.dir={tmp_path}", *TINY_GPT, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**extra_env), capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_bad_layout_prints_one_line_and_fails_every_rank(tmp_path):
    rc, out = _torchrun(tmp_path, "--tp=3")
    assert rc != 0, out
    assert out.count(f"error: {TP_MISMATCH}") == 1, out
    assert "ValueError" not in out and "(rank 1)" not in out, out  # no worker traceback, no second line
    assert "exitcode  : 2" in out, out  # torchrun's summary: rank 0 exited with the user-error status


@pytest.mark.slow
def test_a_bad_key_prints_one_line(tmp_path):
    rc, out = _torchrun(tmp_path, "--train.lrr=1")
    assert rc != 0, out
    assert out.count("error: unknown config key 'train.lrr'") == 1, out
    assert "ValueError" not in out, out


@pytest.mark.slow
def test_debug_restores_the_traceback(tmp_path):
    rc, out = _torchrun(tmp_path, "--tp=3", "--debug")
    assert rc != 0, out
    assert f"ValueError: {TP_MISMATCH}" in out, out
    assert f"error: {TP_MISMATCH}" not in out, out


def test_tpflash_debug_in_the_environment_restores_the_traceback(capsys, monkeypatch):
    # the environment's twin of --debug (read where the flag is), in one process: no launch of its own
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("TPFLASH_DEBUG", "1")
    with pytest.raises(ValueError, match="no such file"):
        cli.main(["--config", "no-such-config"])
    assert "error:" not in capsys.readouterr().err


def test_one_process_prints_the_line_and_returns_the_user_error_status(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TPFLASH_DEBUG", raising=False)
    assert cli.main(["--config", "no-such-config"]) == cli.USER_ERROR_STATUS
    err = capsys.readouterr().err
    assert err.startswith("error: --config 'no-such-config': no such file") and err.count("\n") == 1
    with pytest.raises(ValueError, match="no such file"):
        cli.main(["--config", "no-such-config", "--debug"])


def test_a_rank_whose_error_rank_0_does_not_share_reports_it_itself(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TPFLASH_DEBUG", raising=False)
    monkeypatch.setattr(cli, "OTHER_RANK_GRACE_S", 0.0)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # leave pytest's handlers alone
    assert cli.main(["--tp=x"]) == cli.USER_ERROR_STATUS
    assert capsys.readouterr().err.startswith("error: (rank 1) config key 'tp': cannot read 'x' as int")


def test_bugs_keep_their_traceback(monkeypatch):
    def broken(argv, print_only):
        raise KeyError("a bug")
    monkeypatch.setattr(cli, "_run", broken)
    with pytest.raises(KeyError):
        cli.main([])


def test_help_into_a_pipe_its_reader_has_closed_exits_cleanly():
    """`tpflash-train --help | head -1`: the reader may be gone before the help is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "tpflash.train", "--help"], stdout=write_end,
                              stderr=subprocess.PIPE, timeout=60)
    finally:
        os.close(write_end)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr.decode()[-500:]
