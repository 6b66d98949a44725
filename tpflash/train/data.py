"""Training data: tokenizers, token sources (raw text or np.memmap token files) and a train/eval split.

The token stream is one flat array; sample i is the window tokens[i*seq : i*seq + seq + 1]
(inputs are its first seq tokens, targets its last seq). The last `eval_fraction` of the
stream is held out for evaluation. Which sample each rank reads is decided by
tpflash.train.sampler.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import sysconfig
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .config import DataConfig


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (no merges, no special tokens): needs no files, never fails."""

    vocab_size = 256

    def encode(self, text) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer found locally (a path, or a name in the local cache; no download)."""

    def __init__(self, name: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"tokenizer={name!r} needs the transformers package; install it or use "
                             "tokenizer=byte") from None
        try:
            self.tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds
            raise ValueError(f"tokenizer={name!r} is not available locally ({type(e).__name__}: {e}); "
                             "give a local directory or use tokenizer=byte") from None
        self.vocab_size = len(self.tok)

    def encode(self, text) -> np.ndarray:
        if not isinstance(text, str):
            text = bytes(text).decode("utf-8", errors="replace")
        dtype = np.uint16 if self.vocab_size <= 65536 else np.uint32
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def make_tokenizer(name: str):
    """"byte" (built in) or a local Hugging Face tokenizer."""
    return ByteTokenizer() if name in ("", "byte") else HFTokenizer(name)


def stdlib_dir() -> str:
    """The Python standard library's source directory (text that is on every machine)."""
    return sysconfig.get_paths()["stdlib"]


def _expand(path: str) -> str:
    return stdlib_dir() if path == "@stdlib" else os.path.expanduser(path)


def text_files(paths: Sequence[str], include: Sequence[str], exclude: Sequence[str]) -> List[str]:
    """Files under `paths` (files, directories, globs) whose name matches `include` and whose path
    contains no `exclude` pattern (fnmatch on any path component or the whole path). Sorted."""
    def wanted(p: str) -> bool:
        parts = p.split(os.sep)
        if any(fnmatch.fnmatch(p, e) or any(fnmatch.fnmatch(c, e) for c in parts) for e in exclude):
            return False
        return any(fnmatch.fnmatch(os.path.basename(p), pat) for pat in include)

    found = set()
    for raw in paths:
        path = _expand(raw)
        matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise ValueError(f"data.path {raw!r} does not exist")
        for m in matches:
            if os.path.isdir(m):
                for root, dirs, files in os.walk(m):
                    dirs.sort()
                    found.update(os.path.join(root, f) for f in files if wanted(os.path.join(root, f)))
            elif wanted(m) or not glob.has_magic(path):
                found.add(m)
    return sorted(found)


def token_format(cfg: DataConfig) -> str:
    """"text", "uint16", "uint32" or "jsonl": data.format, or guessed from a single file's extension."""
    if cfg.format != "auto":
        return cfg.format
    if len(cfg.path) == 1:
        ext = os.path.splitext(cfg.path[0])[1]
        if ext in (".bin", ".u16"):
            return "uint16"
        if ext == ".u32":
            return "uint32"
        if ext == ".jsonl":
            return "jsonl"
    return "text"


def load_tokens(cfg: DataConfig, tokenizer) -> np.ndarray:
    """The whole token stream as a 1-D array (a read-only memmap for token files)."""
    if not cfg.path:
        raise ValueError("data.path is empty: give text files/directories or a token file")
    fmt = token_format(cfg)
    if fmt in ("uint16", "uint32"):
        if len(cfg.path) != 1 or not os.path.isfile(cfg.path[0]):
            raise ValueError(f"data.format={fmt} needs exactly one existing token file, got data.path={cfg.path}; "
                             f"make one from text with `python -m tpflash.train.prepare OUT.bin TEXT_PATHS... "
                             f"--tokenizer {cfg.tokenizer}`")
        tokens = open_token_file(cfg.path[0], np.dtype(fmt))
        if cfg.max_bytes:
            tokens = tokens[: cfg.max_bytes // tokens.itemsize]
        return tokens
    return np.concatenate([tokenizer.encode(chunk) for chunk in text_chunks(cfg)])


def open_token_file(path: str, dtype: np.dtype) -> np.memmap:
    """`path` as a read-only memmap of `dtype`; an empty file, or one whose size is not a whole number of
    tokens (a copy cut short), is a ValueError naming the file (numpy's own errors name neither)."""
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"token file {path!r} is empty: it holds no {dtype.name} tokens")
    if size % dtype.itemsize:
        raise ValueError(f"token file {path!r} has {size} bytes, not a multiple of {dtype.itemsize} "
                         f"({dtype.name} tokens): it is truncated or not a {dtype.name} token file")
    return np.memmap(path, dtype=dtype, mode="r")


def token_source(cfg: DataConfig) -> str:
    """How an error names the token stream: the token file, or the text paths and their tokenizer."""
    if token_format(cfg) in ("uint16", "uint32"):
        return f"token file {cfg.path[0]!r}"
    return f"the text of data.path={cfg.path} tokenized by {cfg.tokenizer!r}"


CHECK_CHUNK = 1 << 26  # tokens per chunk of check_token_ids: 128 MiB of uint16, bounded memory on any file


def check_token_ids(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Raise ValueError if any token id is >= vocab_size, naming `source`, the first such id's position
    and value and the vocabulary size. Called before training, because an id outside the embedding
    fails deep inside a step (on GPU as a device-side assert), or not at all on some paths.

    A vectorised max per chunk of the memmap: reads the whole stream once (about a second per GB
    from the page cache), and only the chunk holding a bad id is searched for its position."""
    for start in range(0, len(tokens), CHECK_CHUNK):
        chunk = np.asarray(tokens[start: start + CHECK_CHUNK])
        if int(chunk.max()) >= vocab_size:
            offset = int(np.argmax(chunk >= vocab_size))
            raise ValueError(f"{source}: token id {int(chunk[offset])} at position {start + offset} is outside "
                             f"the model's vocabulary of {vocab_size} (ids 0..{vocab_size - 1}); make the "
                             "token file with the model's tokenizer, or set model.vocab_size")


def text_chunks(cfg: DataConfig) -> Iterator[bytes]:
    """The text a text-format stream is made of: each file's bytes and a newline, in sorted path order,
    at most `max_bytes` in all. Tokenized one file at a time (here and in tpflash.train.prepare)."""
    files = text_files(cfg.path, cfg.include, cfg.exclude)
    if not files:
        raise ValueError(f"no files match data.path={cfg.path} include={cfg.include} exclude={cfg.exclude}")
    total = 0
    for name in files:
        with open(name, "rb") as f:
            data = f.read()
        if cfg.max_bytes and total + len(data) > cfg.max_bytes:
            data = data[: cfg.max_bytes - total]
        yield data + b"\n"
        total += len(data) + 1
        if cfg.max_bytes and total >= cfg.max_bytes:
            break


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats per token) of the tokens' frequency distribution (over at most the first 10M
    tokens): the loss of the best model that ignores context. A model that learned anything beats it."""
    counts = np.zeros(vocab_size, dtype=np.float64)
    for start in range(0, min(len(tokens), 10_000_000), 1_000_000):  # a 10M-token prefix, in 1M chunks
        chunk = np.asarray(tokens[start: start + 1_000_000], dtype=np.int64)
        counts += np.bincount(chunk, minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class TokenWindows:
    """Sample i of a token array: inputs tokens[i*seq : (i+1)*seq], targets shifted by one."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def batch(self, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(indices), seq] int64."""
        s = self.seq_len
        rows = np.stack([np.asarray(self.tokens[i * s: i * s + s + 1], dtype=np.int64) for i in indices])
        rows = torch.from_numpy(rows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def split_train_eval(tokens: np.ndarray, seq_len: int, eval_fraction: float,
                     min_eval: int = 1) -> Tuple[TokenWindows, Optional[TokenWindows]]:
    """The stream's head for training and its tail (eval_fraction of it) held out for evaluation."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction={eval_fraction} must be in [0, 1)")
    n_eval = int(len(tokens) * eval_fraction)
    if eval_fraction > 0:
        n_eval = max(n_eval, min_eval * seq_len + 1)
    train = TokenWindows(tokens[: len(tokens) - n_eval], seq_len)
    held = TokenWindows(tokens[len(tokens) - n_eval:], seq_len) if n_eval else None
    if len(train) == 0:
        raise ValueError(f"{len(tokens)} tokens give no training sample of seq_len={seq_len} "
                         f"after holding out eval_fraction={eval_fraction}")
    return train, held
