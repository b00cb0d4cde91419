"""SHA-256 of whole files without re-reading files whose hash is already known.

A variant's manifest lists the SHA-256 of every input and output file. Hashing a 19.7 GB base costs
≈ 13 s of CPU per pass on the development VM, more than a plain copy of the files takes, so blaze reuses
hashes it can trust:

1. **Hugging Face cache blobs.** `huggingface_hub` stores each file of a snapshot as
   `<cache>/models--Org--name/blobs/<hash>` and links it from `snapshots/<revision>/<file>`. For LFS files
   (all weights) the blob name is the file's SHA-256, checked by `huggingface_hub` at download. Only
   64-hex-digit names are SHA-256; 40-digit names are git SHA-1s of small files and are hashed normally.
2. **A per-file hash cache** at `$BLAZE_CACHE/sha256-cache.json` (default `~/.cache/blaze/`), one entry
   per real path holding (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns) and the digest. It is filled
   whenever blaze hashes a whole file for a manifest (inputs it read, outputs it wrote). An entry is used
   only when all five stat fields still match (the inode change time cannot be set back with `os.utime`
   or `touch -d`, so a file rewritten in place with its old mtime restored is hashed again), and only when the file's mtime is more than 2 s older than the moment the
   hash was taken (git's "racy" rule: a file changed again within the filesystem's timestamp granularity
   could otherwise keep its old mtime). The file is rewritten atomically (temporary file + rename, under
   a lock); an unreadable or corrupt cache is ignored, never fatal. `BLAZE_HASH_CACHE=0` turns the cache off
   (no lookups, no writes); Hub blob names are still used.

Integrity checks that must look at the bytes (`surgery.manifest.verify_manifest`, the release-code trust
check) keep hashing with `clef_model.checkpoint.sha256_file` and never consult this cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from clef_model.checkpoint import sha256_file

ENV_SWITCH = "BLAZE_HASH_CACHE"
CACHE_NAME = "sha256-cache.json"
CACHE_VERSION = 2  # 2: entries also hold st_ctime_ns
MAX_ENTRIES = 20_000
RACY_NS = 2 * 10**9  # an entry is trusted only if the file's mtime is this much older than the hash
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")
_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")


def hub_blob_sha256(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache records for `path` (a snapshot link into `.../blobs/<sha256>`), or None."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and real.parent.parent.name.startswith(_HUB_REPO_PREFIXES) \
            and _SHA256_NAME.fullmatch(real.name):
        return real.name
    return None


def enabled() -> bool:
    """Whether the persistent hash cache is on (`BLAZE_HASH_CACHE=0` turns it off)."""
    from clef_model.env import hash_cache

    return hash_cache()


def cache_path() -> Path:
    """Where the hash cache lives: `$BLAZE_CACHE/sha256-cache.json` (default `~/.cache/blaze/`)."""
    from clef_model.env import cache_root

    return cache_root() / CACHE_NAME


def _stat_key(path: Path) -> tuple[str, dict] | None:
    try:
        real = os.path.realpath(path)
        stat = os.stat(real)
    except OSError:
        return None
    return real, {"dev": stat.st_dev, "ino": stat.st_ino, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                  "ctime_ns": stat.st_ctime_ns}


_memo: dict[str, tuple[tuple, dict[str, dict]]] = {}  # cache file -> (its stat, entries): one parse per change


def _read_entries(path: Path) -> dict[str, dict]:
    """The cache's entries, or {} when the file is missing, unreadable or not a cache (never raises)."""
    try:
        stat = os.stat(path)
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        memo = _memo.get(str(path))
        if memo is not None and memo[0] == signature:
            return dict(memo[1])
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("files"), dict):
        return {}
    entries = {k: v for k, v in data["files"].items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)}
    _memo[str(path)] = (signature, entries)
    return dict(entries)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_sha256(path: Path) -> str | None:
    """The hash cache's digest for `path` when its entry still matches the file (and is not racy), else None."""
    if not enabled():
        return None
    key = _stat_key(path)
    if key is None:
        return None
    real, stat = key
    entry = _read_entries(cache_path()).get(real)
    if not entry or any(entry.get(field) != value for field, value in stat.items()):
        return None
    if not isinstance(entry.get("hashed_ns"), int) or stat["mtime_ns"] + RACY_NS > entry["hashed_ns"]:
        return None
    digest = entry["sha256"]
    return digest if _SHA256_NAME.fullmatch(digest) else None


def known_sha256(path: Path) -> str | None:
    """SHA-256 of `path` without reading it, when known: a Hub blob name, else a valid cache entry; else None."""
    return hub_blob_sha256(path) or cached_sha256(path)


def record_sha256(digests: Mapping[Path, str], *, hashed_ns: int | None = None) -> None:
    """Remember whole-file digests (path -> hex SHA-256) in the cache; failures are ignored.

    `hashed_ns` is when the bytes were hashed (time.time_ns(); default now): entries for files modified
    less than 2 s before it are stored but not trusted (see the module docstring). Hub blobs are skipped
    (their names already say it).
    """
    if not enabled() or not digests:
        return
    hashed_ns = time.time_ns() if hashed_ns is None else int(hashed_ns)
    fresh: dict[str, dict] = {}
    for path, digest in digests.items():
        key = _stat_key(path)
        if key is None or hub_blob_sha256(path) or not _SHA256_NAME.fullmatch(str(digest)):
            continue
        fresh[key[0]] = {**key[1], "sha256": str(digest), "hashed_ns": hashed_ns}
    if not fresh:
        return
    target = cache_path()
    try:
        with _locked(target):
            # drop entries of files that are gone (e.g. deleted temporary folders), and re-insert the
            # fresh ones at the end: when the cache is full, the oldest entries are dropped first
            entries = {real: entry for real, entry in _read_entries(target).items()
                       if real not in fresh and os.path.exists(real)}
            entries.update(fresh)
            if len(entries) > MAX_ENTRIES:
                entries = dict(list(entries.items())[-MAX_ENTRIES:])
            handle, temporary = tempfile.mkstemp(prefix=f".{CACHE_NAME}.", dir=target.parent)
            try:
                with os.fdopen(handle, "w", encoding="utf-8") as out:
                    json.dump({"version": CACHE_VERSION, "files": entries}, out, separators=(",", ":"))
                os.replace(temporary, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
    except OSError:
        pass  # a read-only or full cache folder only costs a re-hash next time


def file_sha256(path: Path) -> str:
    """SHA-256 of a whole file: a known digest when there is one, else hashed now (and recorded)."""
    known = known_sha256(path)
    if known is not None:
        return known
    started = time.time_ns()
    digest = sha256_file(path)
    record_sha256({Path(path): digest}, hashed_ns=started)
    return digest
