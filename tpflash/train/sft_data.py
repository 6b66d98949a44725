"""Fine-tuning examples from JSON-lines files, tokenized with a loss mask.

Each non-blank line of a `.jsonl` file is one example, either

    {"prompt": "...", "completion": "..."}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}

An example becomes its token ids and a mask saying which tokens carry loss (are predicted):

- prompt/completion: the prompt encoded with the tokenizer's special tokens (a Llama tokenizer
  puts BOS first, GPT-2's adds nothing), the completion without them, then the tokenizer's EOS if
  it has one (the byte tokenizer has none). The completion and the EOS carry loss.
- messages: the conversation rendered by the tokenizer's chat template. Each assistant message's
  text is found by rendering the conversation prefix by prefix (up to the message with the
  assistant's generation prompt, then through the message); the tokens that start inside that text
  carry loss, including the end-of-turn marker the template writes after it. The byte tokenizer
  uses BYTE_CHAT_TEMPLATE.

tpflash.train.packing turns the examples into fixed-length training rows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

import numpy as np

from .config import DataConfig
from .data import ByteTokenizer, text_files

# The byte tokenizer's chat template: every message is "<|ROLE|>\nCONTENT<|end|>\n". An assistant
# message's "CONTENT<|end|>\n" carries loss, so a model learns to end its turn with <|end|>.
BYTE_ROLE_HEADER = "<|{role}|>\n"
BYTE_END_OF_TURN = "<|end|>\n"
BYTE_CHAT_TEMPLATE = BYTE_ROLE_HEADER + "{content}" + BYTE_END_OF_TURN


@dataclass
class Example:
    """One tokenized example. ids [n] int64; loss [n] bool: token i is predicted (carries loss);
    where: "file:line" for messages about it."""

    ids: np.ndarray
    loss: np.ndarray
    where: str


def jsonl_files(cfg: DataConfig) -> List[str]:
    """The data files of a jsonl run: data.path (files, directories, globs) under include/exclude, sorted."""
    if not cfg.path:
        raise ValueError("data.path is empty: give one or more .jsonl files")
    files = text_files(cfg.path, cfg.include, cfg.exclude)
    if not files:
        raise ValueError(f"no files match data.path={cfg.path} include={cfg.include} exclude={cfg.exclude}")
    return files


def read_records(path: str) -> Iterator[Tuple[str, dict]]:
    """("file:line", record) for each non-blank line of `path`; ValueError naming file:line for a
    line that is not a JSON object, and naming the file when it holds no example at all."""
    found = False
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a line must be a JSON object, got {type(record).__name__}")
            found = True
            yield where, record
    if not found:
        raise ValueError(f"{path}: the file holds no example (every line is blank)")


def _text(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


def _check_messages(messages, where: str) -> List[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for k, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: messages[{k}] must be an object with string \"role\" and \"content\"")
    return messages


def encode_record(record: dict, tokenizer, where: str) -> Example:
    """The Example of one JSON record (either format); ValueError naming `where` for a bad record."""
    has_pc, has_messages = "prompt" in record or "completion" in record, "messages" in record
    if has_pc and has_messages:
        raise ValueError(f"{where}: a line has either \"prompt\"/\"completion\" or \"messages\", not both")
    if has_messages:
        messages = _check_messages(record["messages"], where)
        if isinstance(tokenizer, ByteTokenizer):
            return _byte_messages(messages, where)
        return _hf_messages(messages, tokenizer, where)
    if "prompt" in record and "completion" in record:
        return _prompt_completion(_text(record, "prompt", where), _text(record, "completion", where), tokenizer, where)
    raise ValueError(f"{where}: a line needs \"prompt\" and \"completion\", or \"messages\"; "
                     f"it has keys {sorted(record)}")


def _prompt_completion(prompt: str, completion: str, tokenizer, where: str) -> Example:
    if isinstance(tokenizer, ByteTokenizer):
        head, tail, eos = tokenizer.encode(prompt), tokenizer.encode(completion), []
    else:
        tok = tokenizer.tok
        head = tok.encode(prompt, add_special_tokens=True)
        tail = tok.encode(completion, add_special_tokens=False)
        eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    ids = np.concatenate([np.asarray(head, np.int64), np.asarray(tail, np.int64), np.asarray(eos, np.int64)])
    loss = np.zeros(len(ids), dtype=bool)
    loss[len(head):] = True
    return Example(ids, loss, where)


def _byte_messages(messages: Sequence[dict], where: str) -> Example:
    """BYTE_CHAT_TEMPLATE, message by message; assistant content and end-of-turn carry loss."""
    ids, loss = [], []
    for m in messages:
        header = ByteTokenizer().encode(BYTE_ROLE_HEADER.format(role=m["role"]))
        body = ByteTokenizer().encode(m["content"] + BYTE_END_OF_TURN)
        ids += [header, body]
        loss += [np.zeros(len(header), bool), np.full(len(body), m["role"] == "assistant")]
    return Example(np.concatenate(ids).astype(np.int64), np.concatenate(loss), where)


def assistant_spans(messages: Sequence[dict], tok, where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """(the rendered conversation, [(start, end) character span of each assistant message]).

    The span of message i runs from the end of the rendering of messages[:i] with the generation
    prompt to the end of the rendering of messages[:i+1]; both must be prefixes of the full text."""
    def render(part, prompt=False):
        return tok.apply_chat_template(list(part), tokenize=False, add_generation_prompt=prompt)

    full, spans = render(messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], prompt=True) if i else "", render(messages[: i + 1])
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(f"{where}: the tokenizer's chat template does not render this conversation prefix by "
                             f"prefix, so the assistant message {i} cannot be located in it")
        spans.append((len(before), len(through)))
    return full, spans


def _hf_messages(messages: Sequence[dict], tokenizer, where: str) -> Example:
    tok = tokenizer.tok
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{where}: \"messages\" need a chat template, and the tokenizer "
                         f"{getattr(tok, 'name_or_path', '')!r} has none: use prompt/completion lines or a "
                         "tokenizer with a chat_template")
    full, spans = assistant_spans(messages, tok, where)
    if not tok.is_fast:
        raise ValueError(f"{where}: \"messages\" need a fast (Rust) tokenizer, which reports each token's "
                         f"characters; {type(tok).__name__} does not")
    # the template writes any BOS itself: no special tokens added on top
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([start for start, _ in enc["offset_mapping"]], dtype=np.int64)
    loss = np.zeros(len(starts), dtype=bool)
    for start, end in spans:
        loss |= (starts >= start) & (starts < end)
    return Example(np.asarray(enc["input_ids"], dtype=np.int64), loss, where)


def load_examples(cfg: DataConfig, tokenizer) -> List[Example]:
    """Every example of the jsonl files, in file and line order."""
    return [encode_record(record, tokenizer, where) for path in jsonl_files(cfg)
            for where, record in read_records(path)]
