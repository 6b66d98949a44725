"""Tokenize text once into the flat token file the trainer memory-maps.

    python -m tpflash.train.prepare OUT.bin PATH [PATH ...] [--tokenizer gpt2] [--include '*.txt']
                                    [--exclude tests] [--max-bytes N] [--workers N]

The file holds exactly the tokens that `data.format: text` reads from the same paths and options
(each file's bytes and a newline, in sorted path order, tokenized one file at a time), as uint16
(OUT ending .bin or .u16: vocabularies of up to 65,536 ids) or uint32 (.u32). Training then reads
it with `--data.path=OUT.bin` and tokenizes nothing at start-up, on any number of ranks. The file
is written as OUT.tmp and renamed when complete, so a crash never leaves a short OUT behind.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Callable, Dict, Iterator, Sequence, Tuple

import numpy as np

from .config import DataConfig
from .data import make_tokenizer, text_chunks, token_format

PROGRESS_EVERY_S = 5.0


_worker_tokenizer = None  # one per worker process of a `workers > 1` run


def _encode_in_worker(args):
    name, chunk = args
    global _worker_tokenizer
    if _worker_tokenizer is None:
        _worker_tokenizer = make_tokenizer(name)
    return _worker_tokenizer.encode(chunk)


def _encoded(chunks: Iterator[bytes], tokenizer, name: str, workers: int) -> Iterator[Tuple[bytes, np.ndarray]]:
    """(chunk, its tokens) in the chunks' order, encoded here or by `workers` processes, a bounded
    batch of files at a time (so the text in memory stays a few files per worker)."""
    if workers <= 1:
        for chunk in chunks:
            yield chunk, tokenizer.encode(chunk)
        return
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        while True:
            batch = list(itertools.islice(chunks, 4 * workers))
            if not batch:
                return
            yield from zip(batch, pool.map(_encode_in_worker, [(name, chunk) for chunk in batch]))


def prepare(out: str, paths: Sequence[str], tokenizer: str = "byte", include: Sequence[str] = ("*",),
            exclude: Sequence[str] = (), max_bytes: int = 0, workers: int = 1,
            progress: Callable[[str], None] = print) -> Dict:
    """Write the token file `out` from the text under `paths`; returns {"tokens", "files", "bytes", "dtype"}.
    `workers` > 1 tokenizes files in that many processes (the file is the same). Progress lines go to
    `progress` every few seconds on long inputs."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    fmt = token_format(DataConfig(path=[out]))
    if fmt == "text":
        raise ValueError(f"out={out!r} must end in .bin or .u16 (uint16 tokens) or .u32 (uint32 tokens), "
                         "the endings the trainer's data.format=auto reads")
    dtype = np.dtype(fmt)
    tok = make_tokenizer(tokenizer)
    if tok.vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"tokenizer={tokenizer!r} has {tok.vocab_size} ids, more than {fmt} holds; "
                         "write a .u32 file")
    cfg = DataConfig(path=list(paths), format="text", include=list(include), exclude=list(exclude),
                     max_bytes=max_bytes, tokenizer=tokenizer)
    done = {"tokens": 0, "files": 0, "bytes": 0, "dtype": fmt}
    start = last = time.monotonic()
    tmp = out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            for chunk, ids in _encoded(text_chunks(cfg), tok, tokenizer, workers):
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                done["tokens"] += len(ids)
                done["files"] += 1
                done["bytes"] += len(chunk)
                if time.monotonic() - last > PROGRESS_EVERY_S:
                    last = time.monotonic()
                    progress(f"[prepare] {done['files']} files, {done['bytes'] / 1e6:.1f} MB of text, "
                             f"{done['tokens']:,} tokens ({done['bytes'] / 1e6 / (last - start):.1f} MB/s)")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return done


def main(argv=None) -> int:
    """Command line of `python -m tpflash.train.prepare`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tpflash.train.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the token file: .bin or .u16 (uint16), .u32 (uint32)")
    parser.add_argument("paths", nargs="+", help="text files, directories or globs (@stdlib: Python's own sources)")
    parser.add_argument("--tokenizer", default="byte", help="byte (built in) or a local Hugging Face tokenizer")
    parser.add_argument("--include", nargs="+", default=["*"], help="file-name patterns to read (default: all)")
    parser.add_argument("--exclude", nargs="+", default=[], help="path patterns to skip")
    parser.add_argument("--max-bytes", type=int, default=0, help="stop after this much text (0: all)")
    parser.add_argument("--workers", type=int, default=1, help="processes that tokenize files (default 1)")
    args = parser.parse_args(argv)
    try:
        done = prepare(args.out, args.paths, args.tokenizer, args.include, args.exclude, args.max_bytes,
                       args.workers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {done['tokens']:,} tokens ({done['dtype']}) from {done['files']} files "
          f"({done['bytes'] / 1e6:.1f} MB of text) to {args.out}; train on it with --data.path={args.out}"
          + ("" if args.tokenizer == "byte" else f" --data.tokenizer={args.tokenizer}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
