"""The files a save writes: every byte lands at its place, with direct I/O where the filesystem takes it
and through the page cache where not, each block hashed as it is written, and a failed write fails
the file instead of leaving it short."""
import errno
import hashlib
import os

import pytest

import tpflash
from tests.checkpoint.tiny_model import build, make_optimizer
from tpflash.checkpoint import shard_files
from tpflash.checkpoint.shard_files import ALIGN, ShardFileSystem
from tpflash.train.config import parse_args
from tpflash.train.faults import Fault
from tpflash.train.run_checkpoints import RunCheckpoints

PIECES = (b"abc" * 5000, bytearray(b"xyz"), memoryview(b"0123456789"), b"", os.urandom(3 * ALIGN + 5))


def _sha256_blocks(data: bytes, block_bytes: int):
    return [hashlib.sha256(data[i:i + block_bytes]).hexdigest() for i in range(0, len(data), block_bytes)]


def _write(fs: ShardFileSystem, path, pieces=PIECES) -> bool:
    """Write `pieces` to `path` through `fs`; whether the stream wrote with direct I/O."""
    with fs.create_stream(path, "wb") as f:
        offset = 0
        for piece in pieces:
            assert f.tell() == offset
            f.write(piece)
            offset += memoryview(piece).nbytes
        direct = f.direct
    return direct


def _takes_direct_io(directory) -> bool:
    try:
        os.close(os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("block_bytes", [2 * ALIGN, 7], ids=["aligned-blocks", "odd-blocks"])
def test_a_shard_file_holds_every_byte_written_and_the_digest_of_each_block(tmp_path, direct, block_bytes):
    with ShardFileSystem(block_bytes=block_bytes, direct=direct) as fs:
        _write(fs, tmp_path / "shard")
        _write(fs, tmp_path / "empty", pieces=())
    data = (tmp_path / "shard").read_bytes()
    assert data == b"".join(bytes(p) for p in PIECES)
    assert fs.digests == {"shard": _sha256_blocks(data, block_bytes), "empty": []}


def test_direct_io_is_used_where_the_filesystem_takes_it(tmp_path):
    if not _takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    with ShardFileSystem(block_bytes=2 * ALIGN) as fs:
        assert _write(fs, tmp_path / "shard")
        assert not _write(ShardFileSystem(direct=False), tmp_path / "cached")


def test_a_filesystem_that_refuses_direct_io_at_open_gets_the_page_cache(tmp_path, monkeypatch):
    real_open = os.open

    def open_without_direct(path, flags, *mode):
        if flags & shard_files._DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *mode)

    monkeypatch.setattr(shard_files.os, "open", open_without_direct)
    with ShardFileSystem(block_bytes=2 * ALIGN) as fs:
        assert not _write(fs, tmp_path / "shard")
    assert (tmp_path / "shard").read_bytes() == b"".join(bytes(p) for p in PIECES)


def test_a_direct_write_the_filesystem_refuses_is_written_through_the_page_cache(tmp_path, monkeypatch):
    if not _takes_direct_io(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    real_pwrite, refused = os.pwrite, []

    def pwrite_refusing_direct(fd, data, offset):
        if shard_files.fcntl.fcntl(fd, shard_files.fcntl.F_GETFL) & shard_files._DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(shard_files.os, "pwrite", pwrite_refusing_direct)
    with ShardFileSystem(block_bytes=2 * ALIGN) as fs:
        _write(fs, tmp_path / "shard")
    assert refused and (tmp_path / "shard").read_bytes() == b"".join(bytes(p) for p in PIECES)


def test_a_write_refused_under_direct_io_is_retried_after_another_thread_turned_it_off(tmp_path, monkeypatch):
    # two blocks' writes refused at once: the first clears O_DIRECT, the second must retry, not fail
    if not shard_files._DIRECT:
        pytest.skip("no O_DIRECT here")
    real_pwrite, calls = os.pwrite, []

    def refused_once(fd, data, offset):
        calls.append(offset)
        if len(calls) == 1:  # refused while O_DIRECT was on; the descriptor has none by the time it is checked
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(shard_files.os, "pwrite", refused_once)
    fd = os.open(tmp_path / "shard", os.O_WRONLY | os.O_CREAT)
    try:
        shard_files._pwrite_all(fd, memoryview(b"abcd"), 0)
    finally:
        os.close(fd)
    assert calls == [0, 0] and (tmp_path / "shard").read_bytes() == b"abcd"


def test_a_failed_write_fails_the_file_at_close(tmp_path, monkeypatch):
    def disk_full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shard_files.os, "pwrite", disk_full)
    with ShardFileSystem(block_bytes=2 * ALIGN) as fs:
        with pytest.raises(OSError, match="No space left"):
            _write(fs, tmp_path / "shard")
    assert fs.digests == {}


def test_a_shard_file_is_written_front_to_back_and_refuses_a_seek(tmp_path):
    with ShardFileSystem() as fs:
        with fs.create_stream(tmp_path / "shard", "wb") as f:
            f.write(b"aaaa")
            with pytest.raises(OSError, match="front to back"):
                f.seek(0)


def _recording_opens(asked: list):
    """shard_files._open_for_writing, appending each call's `direct` argument to `asked`."""
    real = shard_files._open_for_writing
    return lambda path, direct: (asked.append(direct), real(path, direct))[1]


def _direct_flags_of_a_save(tmp_path, monkeypatch, **save_kwargs) -> set:
    """The `direct` argument of every file a save of the tiny model opened."""
    asked = []
    monkeypatch.setattr(shard_files, "_open_for_writing", _recording_opens(asked))
    model = build(seed=0, tp=False)
    tpflash.checkpoint.save(tmp_path, model, make_optimizer(model), step=1, **save_kwargs)
    return set(asked)


@pytest.mark.usefixtures("single_process")
def test_a_save_writes_with_direct_io_unless_told_not_to(tmp_path, monkeypatch):
    assert _direct_flags_of_a_save(tmp_path / "default", monkeypatch) == {True}
    assert _direct_flags_of_a_save(tmp_path / "cached", monkeypatch, direct_io=False) == {False}
    with pytest.raises(ValueError, match="direct_io='no' must be True or False"):
        tpflash.checkpoint.save(tmp_path / "bad", build(seed=0, tp=False), direct_io="no")


def trainer_save_body(directory: str) -> list:
    """One rank: the trainer's checkpoint machinery, configured with checkpoint.direct_io=false, saves the
    tiny model; the `direct` argument of every file it opened."""
    asked = []
    shard_files._open_for_writing = _recording_opens(asked)
    cfg = parse_args([f"--checkpoint.dir={directory}", "--checkpoint.direct_io=false"])
    run, model = RunCheckpoints(cfg), build(seed=0, tp=False)
    run.save(1, model, make_optimizer(model), final=True, fault=Fault(0, 1, spec=""))
    return asked


def test_the_trainers_checkpoint_direct_io_key_reaches_its_saves(ranks, tmp_path):
    asked = ranks(1).run(trainer_save_body, str(tmp_path / "run"))[0]
    assert asked and set(asked) == {False}
