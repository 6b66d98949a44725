"""Fine-tuning examples from jsonl: which tokens carry loss, the chat templates, and bad lines."""
import json

import numpy as np
import pytest

from tests.train.sft_common import chat_tokenizer, write_jsonl
from tpflash.train.config import DataConfig
from tpflash.train.data import ByteTokenizer, make_tokenizer, token_format
from tpflash.train.packing import IGNORE_INDEX, document
from tpflash.train.sft_data import encode_record, load_examples

CONVERSATION = [{"role": "system", "content": "hi"}, {"role": "user", "content": "what is two plus three"},
                {"role": "assistant", "content": "five"}, {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "bye"}]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    pytest.importorskip("transformers")
    return make_tokenizer(chat_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def _words(tok, ids):
    return tok.tok.convert_ids_to_tokens([int(i) for i in ids])


def test_prompt_targets_are_ignored_and_completion_targets_are_the_next_tokens():
    ex = encode_record({"prompt": "ab=", "completion": "xy"}, ByteTokenizer(), "f:1")
    inputs, targets = document(ex, seq_len=16)
    assert bytes(inputs.astype(np.uint8)) == b"ab=xy"
    # position j predicts token j+1: "a"->"b" and "b"->"=" are prompt, "="->"x" and "x"->"y" count, "y" ends it
    assert targets.tolist() == [IGNORE_INDEX, IGNORE_INDEX, ord("x"), ord("y"), IGNORE_INDEX]


def test_eos_follows_the_completion_and_carries_loss(chat_tok):
    ex = encode_record({"prompt": "what is two plus three", "completion": "five"}, chat_tok, "f:1")
    assert _words(chat_tok, ex.ids) == ["what", "is", "two", "plus", "three", "five", "</s>"]
    assert ex.loss.tolist() == [False] * 5 + [True, True]


def test_only_assistant_turns_carry_loss_under_a_chat_template(chat_tok):
    ex = encode_record({"messages": CONVERSATION}, chat_tok, "f:1")
    counted = [w for w, loss in zip(_words(chat_tok, ex.ids), ex.loss) if loss]
    assert counted == ["five", "</s>", "bye", "</s>"]  # each reply and the end of its turn
    rendered = chat_tok.tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert _words(chat_tok, ex.ids) == rendered.split(), "the ids are the template's rendering"


def test_byte_tokenizer_messages_follow_the_builtin_template():
    ex = encode_record({"messages": CONVERSATION[1:3]}, ByteTokenizer(), "f:1")
    text = bytes(ex.ids.astype(np.uint8)).decode()
    assert text == "<|user|>\nwhat is two plus three<|end|>\n<|assistant|>\nfive<|end|>\n"
    assert bytes(ex.ids[ex.loss].astype(np.uint8)).decode() == "five<|end|>\n"


def test_messages_without_a_chat_template_name_the_line(tmp_path):
    pytest.importorskip("transformers")
    tok = make_tokenizer(chat_tokenizer(str(tmp_path / "tok"), template=False))
    path = write_jsonl(str(tmp_path / "chat.jsonl"), [{"prompt": "hi", "completion": "bye"}, {"messages": CONVERSATION}])
    with pytest.raises(ValueError, match=r"chat.jsonl:2: \"messages\" need a chat template"):
        load_examples(DataConfig(path=[path]), tok)


@pytest.mark.parametrize("line, rule", [
    ('{"prompt": "a", "completion": ', r"invalid JSON"),
    ('{"prompt": "a"}', r"a line needs \"prompt\" and \"completion\", or \"messages\"; it has keys \['prompt'\]"),
    ('{"text": "a"}', r"a line needs \"prompt\" and \"completion\", or \"messages\""),
    ('["a", "b"]', r"a line must be a JSON object, got list"),
    ('{"prompt": "a", "completion": 3}', r"\"completion\" must be a string, got int"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object with string \"role\" and \"content\""),
], ids=["json", "no-completion", "neither", "not-object", "not-string", "no-content"])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, rule):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=f"data.jsonl:3: {rule}"):
        load_examples(DataConfig(path=[str(path)]), ByteTokenizer())


def test_an_empty_file_is_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty.jsonl: the file holds no example"):
        load_examples(DataConfig(path=[str(tmp_path / "empty.jsonl")]), ByteTokenizer())


def test_a_single_jsonl_file_means_format_jsonl():
    assert token_format(DataConfig(path=["x/train.jsonl"])) == "jsonl"
    assert token_format(DataConfig(path=["a.jsonl", "b.jsonl"])) == "text"  # several: say format=jsonl


def test_the_bundled_example_data_loads():
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    examples = load_examples(DataConfig(path=[os.path.join(root, "examples", "data", "tiny_sft.jsonl")]),
                             ByteTokenizer())
    assert len(examples) >= 150 and all(ex.loss.any() for ex in examples)
