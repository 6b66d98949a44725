"""Token sources: text through the byte or a local Hugging Face tokenizer, memmapped token files, the split."""
import numpy as np
import pytest

from tpflash.train.config import DataConfig
from tpflash.train.data import (ByteTokenizer, load_tokens, make_tokenizer, split_train_eval, text_files,
                                unigram_entropy)


def test_text_files_follow_include_and_exclude(tmp_path):
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    for name in ("a.py", "b.txt", "pkg/c.py", "pkg/tests/d.py"):
        (tmp_path / name).write_text("x = 1\n")
    found = text_files([str(tmp_path)], include=["*.py"], exclude=["tests"])
    assert [p[len(str(tmp_path)) + 1:] for p in found] == ["a.py", "pkg/c.py"]


def test_byte_text_round_trips_and_max_bytes_cuts(tmp_path):
    (tmp_path / "t.txt").write_text("héllo wörld")
    cfg = DataConfig(path=[str(tmp_path / "t.txt")], max_bytes=6)
    tokens = load_tokens(cfg, ByteTokenizer())
    assert ByteTokenizer().decode(tokens) == "héllo\n" and len(tokens) == 6 + 1  # 6 bytes + the separator


@pytest.mark.parametrize("dtype, ext", [(np.uint16, ".bin"), (np.uint32, ".u32")])
def test_token_files_are_memmapped_by_extension(tmp_path, dtype, ext):
    path = tmp_path / f"tokens{ext}"
    np.arange(1000, dtype=dtype).tofile(path)
    tokens = load_tokens(DataConfig(path=[str(path)]), None)
    assert isinstance(tokens, np.memmap) and tokens.dtype == dtype and tokens[999] == 999
    train, held = split_train_eval(tokens, seq_len=9, eval_fraction=0.1)
    x, y = train.batch([0, 2])
    assert x.tolist()[1] == list(range(18, 27)) and y.tolist()[1] == list(range(19, 28))
    assert held.tokens[0] == 900  # the tail is held out


def test_a_missing_token_file_names_it_and_how_to_make_one(tmp_path):
    missing = str(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"needs exactly one existing token file, got data.path=\[.*train.bin'\]; "
                       r"make one from text with `python -m tpflash.train.prepare OUT.bin TEXT_PATHS... --tokenizer gpt2`"):
        load_tokens(DataConfig(path=[missing], tokenizer="gpt2"), None)


def test_local_hugging_face_tokenizer_is_used_when_named(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "def": 1, "f": 2, "(": 3, ")": 4, ":": 5}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(tmp_path)
    tok = make_tokenizer(str(tmp_path))
    assert tok.vocab_size == 6 and tok.encode("def f ( ) :").tolist() == [1, 2, 3, 4, 5]


def test_missing_tokenizer_says_it_is_not_available_locally():
    with pytest.raises(ValueError, match="tokenizer='/no/such/tokenizer' is not available locally"):
        make_tokenizer("/no/such/tokenizer")


def test_unigram_entropy_of_two_equal_symbols_is_log2():
    assert unigram_entropy(np.array([3, 7, 3, 7]), 256) == pytest.approx(np.log(2))
