"""Checksums of a checkpoint: block digests taken while the files are written, checked at load, and
manifests of the earlier one-digest-per-file format still checked."""
import hashlib
import json
import os

import pytest

import tpflash
from tests.checkpoint.tiny_model import build, make_optimizer, train
from tpflash.checkpoint import integrity
from tpflash.checkpoint.integrity import CheckpointCorruptError


pytestmark = pytest.mark.usefixtures("single_process")


def _sha256_blocks(data: bytes, block_bytes: int):
    return [hashlib.sha256(data[i:i + block_bytes]).hexdigest() for i in range(0, len(data), block_bytes)]


def _saved(tmp_path):
    model = build(seed=0, tp=False)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(2))
    return tpflash.checkpoint.save(tmp_path, model, optimizer, step=1)


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_save_hashes_its_shard_files_while_writing_them_and_the_manifest_matches_the_bytes(tmp_path, monkeypatch):
    read_back, real = [], integrity._block_sha256
    monkeypatch.setattr(integrity, "_block_sha256", lambda path, *a: (read_back.append(os.path.basename(path)),
                                                                       real(path, *a))[1])
    path = _saved(tmp_path)
    assert not [n for n in read_back if n.endswith(".distcp")], read_back
    with open(os.path.join(path, "manifest.json")) as f:
        files = json.load(f)["files"]
    assert any(n.endswith(".distcp") for n in files)
    for name, entry in files.items():
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert entry["bytes"] == len(data) and entry["block_bytes"] == integrity.BLOCK_BYTES, name
        assert entry["sha256_blocks"] == _sha256_blocks(data, integrity.BLOCK_BYTES), name


def test_hash_files_reads_back_only_the_files_not_hashed_while_written(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 20)
    (tmp_path / "b").write_bytes(b"")
    entries = integrity.hash_files(str(tmp_path), ["a", "b"], known={"c": ["unused"]}, block_bytes=8)
    assert entries == {"a": {"bytes": 20, "block_bytes": 8, "sha256_blocks": _sha256_blocks(b"x" * 20, 8)},
                       "b": {"bytes": 0, "block_bytes": 8, "sha256_blocks": []}}
    assert integrity.hash_files(str(tmp_path), ["a"], known={"a": ["given"]}, block_bytes=8)["a"]["sha256_blocks"] == ["given"]


def test_a_changed_byte_in_any_block_fails_the_check_naming_the_file(tmp_path):
    (tmp_path / "data").write_bytes(os.urandom(100))
    integrity.write_manifest(str(tmp_path), integrity.hash_files(str(tmp_path), ["data"], block_bytes=16))
    integrity.verify(str(tmp_path))
    _flip_byte(str(tmp_path / "data"), 70)  # the fifth of seven blocks
    with pytest.raises(CheckpointCorruptError, match="file data fails its sha256 checksum"):
        integrity.verify(str(tmp_path))


def test_ranks_share_the_blocks_and_together_check_every_one(tmp_path):
    (tmp_path / "data").write_bytes(os.urandom(100))
    integrity.write_manifest(str(tmp_path), integrity.hash_files(str(tmp_path), ["data"], block_bytes=16))
    _flip_byte(str(tmp_path / "data"), 20)  # block 1: rank 1's of two
    found = [integrity._problems(str(tmp_path), rank, 2, deep=True) for rank in range(2)]
    assert found == [[], ["file data fails its sha256 checksum"]]


def test_a_manifest_with_one_digest_per_file_is_still_checked(tmp_path):
    data = os.urandom(100)
    (tmp_path / "data").write_bytes(data)
    with open(tmp_path / "manifest.json", "w") as f:
        json.dump({"format": "tpflash-checkpoint-1",
                   "files": {"data": {"bytes": 100, "sha256": hashlib.sha256(data).hexdigest()}}}, f)
    integrity.verify(str(tmp_path))
    _flip_byte(str(tmp_path / "data"), 99)
    with pytest.raises(CheckpointCorruptError, match="file data fails its sha256 checksum"):
        integrity.verify(str(tmp_path))


def test_a_block_list_that_does_not_fit_the_size_is_corrupt(tmp_path):
    (tmp_path / "data").write_bytes(b"y" * 40)
    entries = integrity.hash_files(str(tmp_path), ["data"], block_bytes=16)
    entries["data"]["sha256_blocks"].pop()
    integrity.write_manifest(str(tmp_path), entries)
    with pytest.raises(CheckpointCorruptError, match="file data has 3 blocks, the manifest lists 2"):
        integrity.verify(str(tmp_path), deep=False)


def _two_writers(tmp_path) -> None:
    """Shard files of ranks 0 and 1, three 16-byte blocks each, in a manifest."""
    for rank in (0, 1):
        (tmp_path / f"__{rank}_0.distcp").write_bytes(os.urandom(48))
    names = ["__0_0.distcp", "__1_0.distcp"]
    integrity.write_manifest(str(tmp_path), integrity.hash_files(str(tmp_path), names, block_bytes=16))


def test_at_the_world_size_of_the_save_each_rank_checks_the_files_it_wrote(tmp_path):
    _two_writers(tmp_path)
    _flip_byte(str(tmp_path / "__1_0.distcp"), 20)  # block 4 of 6 over all files: rank 0's one by one, 1's by writer
    found = [integrity._problems(str(tmp_path), rank, 2, deep=True) for rank in range(2)]
    assert found == [[], ["file __1_0.distcp fails its sha256 checksum"]]


def test_at_another_world_size_the_ranks_share_the_blocks_one_by_one(tmp_path):
    _two_writers(tmp_path)
    _flip_byte(str(tmp_path / "__1_0.distcp"), 0)  # block 3 of 6 over all files: rank 0 of 3
    found = [integrity._problems(str(tmp_path), rank, 3, deep=True) for rank in range(3)]
    assert found == [["file __1_0.distcp fails its sha256 checksum"], [], []]
