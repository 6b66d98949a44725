"""`python -m tpflash.train.prepare` writes the tokens the trainer's text mode reads, as a token file it memory-maps."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tpflash.train.config import DataConfig
from tpflash.train.data import ByteTokenizer, load_tokens
from tpflash.train.prepare import prepare

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "text"
    for i, sub in enumerate(["a", "b", "b/tests"]):
        os.makedirs(root / sub, exist_ok=True)
        (root / sub / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # é\n" * (i + 3))
        (root / sub / f"notes{i}.txt").write_text("not python\n")
    return str(root)


def _text_mode(corpus, **kw):
    return load_tokens(DataConfig(path=[corpus], format="text", **kw), ByteTokenizer())


def test_token_file_holds_the_tokens_text_mode_reads(corpus, tmp_path):
    out = str(tmp_path / "train.bin")
    done = prepare(out, [corpus], include=["*.py"], exclude=["tests"])
    expected = _text_mode(corpus, include=["*.py"], exclude=["tests"])
    assert done == {"tokens": len(expected), "files": 2, "bytes": len(expected), "dtype": "uint16"}
    assert np.array_equal(np.fromfile(out, dtype=np.uint16), expected)
    assert np.array_equal(load_tokens(DataConfig(path=[out]), None), expected), "the trainer's auto format"


def test_u32_files_hold_uint32_tokens(corpus, tmp_path):
    out = str(tmp_path / "train.u32")
    prepare(out, [corpus])
    assert np.array_equal(np.fromfile(out, dtype=np.uint32), _text_mode(corpus))


def test_max_bytes_cuts_the_text_as_text_mode_does(corpus, tmp_path):
    out = str(tmp_path / "train.bin")
    expected = _text_mode(corpus, max_bytes=50)
    assert prepare(out, [corpus], max_bytes=50)["tokens"] == len(expected) == 51  # 50 bytes of text, then "\n"
    assert np.array_equal(np.fromfile(out, dtype=np.uint16), expected)


def test_an_ending_the_trainer_cannot_read_is_refused_before_anything_is_written(corpus, tmp_path):
    out = str(tmp_path / "train.txt")
    with pytest.raises(ValueError, match=r"out='.*train.txt' must end in .bin or .u16 \(uint16 tokens\) or .u32"):
        prepare(out, [corpus])
    assert os.listdir(tmp_path) == ["text"]


def test_cli_reports_what_it_wrote_and_leaves_no_temporary_file(corpus, tmp_path):
    out = str(tmp_path / "data" / "train.bin")
    done = subprocess.run([sys.executable, "-m", "tpflash.train.prepare", out, corpus, "--include", "*.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "from 3 files" in done.stdout and f"--data.path={out}" in done.stdout
    assert os.listdir(tmp_path / "data") == ["train.bin"]


def test_several_workers_write_the_same_file(tmp_path):
    many = tmp_path / "many"
    many.mkdir()
    for i in range(21):  # several batches of 4 * workers files
        (many / f"{i:02d}.txt").write_text(f"file {i}: " + "é" * i + "\n")
    one, two = str(tmp_path / "one.bin"), str(tmp_path / "two.bin")
    assert prepare(one, [str(many)]) == prepare(two, [str(many)], workers=2)
    assert open(one, "rb").read() == open(two, "rb").read()
