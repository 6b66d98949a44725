"""Bad token data is refused before training, in one error naming the file and the rule: ids outside the
model's vocabulary (anywhere, the last token included), truncated and empty token files."""
import numpy as np
import pytest
import torch.distributed as dist

from tests.train.common import tiny_config, write_corpus
from tests.train.tiny_model import TinyConfig, TinyLM
from tpflash.train import data
from tpflash.train.config import DataConfig
from tpflash.train.loop import Trainer

VOCAB = 256  # TinyConfig's


def _token_file(tmp_path, ids, name="train.bin"):
    path = tmp_path / name
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return str(path)


@pytest.mark.parametrize("where", [0, 517, 999])  # first, middle, last token
def test_an_out_of_vocabulary_id_stops_the_trainer_before_any_step(tmp_path, where):
    ids = np.arange(1000) % VOCAB
    ids[where] = 300
    path = _token_file(tmp_path, ids)
    with pytest.raises(ValueError) as info:
        Trainer(tiny_config(path), TinyConfig, TinyLM)
    message = str(info.value)
    assert f"token file {path!r}: token id 300 at position {where} is outside the model's vocabulary of 256" \
        in message, message
    assert not dist.is_initialized()  # raised while loading data: no collective could hang on it


def test_the_first_bad_id_is_found_in_a_later_chunk(monkeypatch):
    monkeypatch.setattr(data, "CHECK_CHUNK", 7)
    ids = np.zeros(50, dtype=np.uint32)
    ids[[23, 41]] = [70000, 5]
    with pytest.raises(ValueError, match=r"src: token id 70000 at position 23 is outside the model's vocabulary "
                                         r"of 10 \(ids 0..9\)"):
        data.check_token_ids(ids, 10, "src")
    data.check_token_ids(ids[:23], 10, "src")  # all inside: nothing raised


def test_text_tokens_are_checked_against_a_smaller_model_vocabulary(tmp_path):
    corpus = write_corpus(str(tmp_path))  # ASCII code: bytes up to 'x' (120)
    with pytest.raises(ValueError, match=r"the text of data.path=\[.*corpus.txt'\] tokenized by 'byte': token id "
                                         r"\d+ at position \d+ is outside the model's vocabulary of 100"):
        Trainer(tiny_config(corpus, model={"block_size": 16, "vocab_size": 100}), TinyConfig, TinyLM)


def test_a_truncated_token_file_names_the_file_and_its_size(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(b"\x01\x00\x02\x00\x03")  # two and a half uint16 tokens
    with pytest.raises(ValueError, match=r"token file '.*train.bin' has 5 bytes, not a multiple of 2 \(uint16 "
                                         r"tokens\): it is truncated"):
        data.load_tokens(DataConfig(path=[str(path)]), None)


def test_an_empty_token_file_names_the_file(tmp_path):
    path = tmp_path / "train.u32"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"token file '.*train.u32' is empty: it holds no uint32 tokens"):
        data.load_tokens(DataConfig(path=[str(path)]), None)


def test_a_valid_token_file_passes(tmp_path):
    path = _token_file(tmp_path, np.arange(2000) % VOCAB)
    tokens = data.load_tokens(DataConfig(path=[path]), None)
    data.check_token_ids(tokens, VOCAB, path)
