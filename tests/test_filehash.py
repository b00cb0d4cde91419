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


def test_file_changed_in_place_with_mtime_restored_is_hashed_again(tmp_path, cache_on):
    """Rewriting a file in place (same inode, same size) and restoring its mtime cannot fool the cache: the
    inode change time is part of the key and `os.utime` cannot set it back."""
    path = _old_file(tmp_path / "shard.bin", b"original bytes!")
    digest = filehash.file_sha256(path)
    assert filehash.known_sha256(path) == digest
    stat = path.stat()
    time.sleep(0.01)  # let the clock (and so the next ctime) move on, even on a coarse-grained filesystem
    with open(path, "r+b") as handle:  # in place: same inode, same size
        handle.write(b"CHANGED")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    assert after.st_ctime_ns != stat.st_ctime_ns
    assert filehash.known_sha256(path) is None
    assert filehash.file_sha256(path) == sha256_file(path) != digest


def test_patch_identity_does_not_depend_on_the_hash_cache(tiny_release, tmp_path, monkeypatch):
    """The base identity a patch records (and the manifest copies) is the same with a cold cache, a warm
    cache and no cache: a first edit and a rerun write byte-identical patch files."""
    from surgery.delta import base_identity

    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "blaze-cache"))
    names = ["model.language_model.layers.3.mlp.down_proj"]
    identities = []
    for switch in ("0", "1", "1"):  # off, then cold, then warm (the first "1" filled it)
        monkeypatch.setenv("BLAZE_HASH_CACHE", switch)
        for shard in tiny_release.glob("*.safetensors"):  # make the entries non-racy where they exist
            filehash.record_sha256({shard: sha256_file(shard)}, hashed_ns=time.time_ns() + 10**10)
        identities.append(json.dumps(base_identity(type("R", (), {"path": tiny_release, "ref": "t",
                                                                  "revision": None})(), names), sort_keys=True))
    assert any(filehash.known_sha256(s) for s in tiny_release.glob("*.safetensors"))  # the cache was warm
    assert identities[0] == identities[1] == identities[2]
