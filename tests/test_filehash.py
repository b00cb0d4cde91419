"""clef_model.filehash: Hub blob names and the per-file hash cache (validity, racy entries, corruption, switch)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from clef_model import filehash
from clef_model.checkpoint import sha256_file


@pytest.fixture
def cache_on(tmp_path, monkeypatch) -> Path:
    """The hash cache switched on, in a private BLAZE_CACHE."""
    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "blaze-cache"))
    monkeypatch.setenv("BLAZE_HASH_CACHE", "1")
    return tmp_path / "blaze-cache" / filehash.CACHE_NAME


def _old_file(path: Path, data: bytes) -> Path:
    """A file whose mtime is well in the past (so a fresh cache entry for it is not racy)."""
    path.write_bytes(data)
    past = time.time_ns() - 60 * 10**9
    os.utime(path, ns=(past, past))
    return path


def test_hub_blob_names_are_trusted_only_when_they_are_sha256(tmp_path):
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    data = b"weights"
    big = repo / "blobs" / hashlib.sha256(data).hexdigest()
    big.write_bytes(data)
    small = repo / "blobs" / hashlib.sha1(b"x").hexdigest()  # 40 hex digits: a git SHA-1, not trusted
    small.write_bytes(b"config")
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(big, snapshot))
    (snapshot / "config.json").symlink_to(os.path.relpath(small, snapshot))
    assert filehash.hub_blob_sha256(snapshot / "model.safetensors") == hashlib.sha256(data).hexdigest()
    assert filehash.hub_blob_sha256(snapshot / "config.json") is None
    # a 64-hex name outside a Hub cache repository is not trusted either
    elsewhere = tmp_path / "blobs" / ("b" * 64)
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(data)
    assert filehash.hub_blob_sha256(elsewhere) is None


def test_cache_round_trip_and_invalidation(tmp_path, cache_on):
    path = _old_file(tmp_path / "f.bin", b"hello world")
    assert filehash.known_sha256(path) is None
    digest = filehash.file_sha256(path)
    assert digest == sha256_file(path) and cache_on.is_file()
    assert filehash.known_sha256(path) == digest
    # a link to the file resolves to the same entry
    (tmp_path / "link").symlink_to(path)
    assert filehash.known_sha256(tmp_path / "link") == digest
    # same size, new content and mtime: the entry no longer matches
    _old_file(path, b"HELLO WORLD")
    os.utime(path, ns=(time.time_ns() - 30 * 10**9,) * 2)
    assert filehash.known_sha256(path) is None
    assert filehash.file_sha256(path) == hashlib.sha256(b"HELLO WORLD").hexdigest()
    # replaced by another file with other content and the same size
    path.unlink()
    _old_file(path, b"hello again")
    assert filehash.file_sha256(path) == hashlib.sha256(b"hello again").hexdigest()


def test_racy_entries_are_not_trusted(tmp_path, cache_on):
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"just written")  # mtime = now: modified within the racy window of the hash
    filehash.record_sha256({path: sha256_file(path)})
    assert filehash.known_sha256(path) is None
    filehash.record_sha256({path: sha256_file(path)}, hashed_ns=path.stat().st_mtime_ns + 3 * 10**9)
    assert filehash.known_sha256(path) == sha256_file(path)


def test_corrupt_cache_is_ignored_and_replaced(tmp_path, cache_on):
    path = _old_file(tmp_path / "f.bin", b"data")
    cache_on.parent.mkdir(parents=True)
    for junk in (b"{not json", json.dumps({"version": 1, "files": []}).encode(), b"[1, 2]", b"\xff\xfe"):
        cache_on.write_bytes(junk)
        assert filehash.known_sha256(path) is None
        assert filehash.file_sha256(path) == sha256_file(path)
        assert filehash.known_sha256(path) == sha256_file(path)  # rewritten as a valid cache
    cache_on.write_text(json.dumps({"version": 1, "files": {os.path.realpath(path): {"sha256": "zz"}}}))
    assert filehash.known_sha256(path) is None


def test_switch_off_and_unwritable_cache(tmp_path, cache_on, monkeypatch):
    path = _old_file(tmp_path / "f.bin", b"data")
    monkeypatch.setenv("BLAZE_HASH_CACHE", "0")
    assert filehash.file_sha256(path) == sha256_file(path)
    assert not cache_on.exists() and filehash.known_sha256(path) is None
    monkeypatch.setenv("BLAZE_HASH_CACHE", "1")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("BLAZE_CACHE", str(blocker))  # the cache folder cannot be created: never fatal
    assert filehash.file_sha256(path) == sha256_file(path)
