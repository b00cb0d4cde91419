"""Streaming execute: base checkpoint + patch -> a drop-in variant folder (no model, no GPU, no torch).

Every tensor of the base is streamed to new shards in on-disk order: untouched tensors as raw bytes
(bit-identical, never through a dtype round trip; the kernel copies them with `copy_file_range`), edited
ones row block by row block through `surgery.delta.RowBlockUpdate` (W + U Vᵀ in float32, cast back to the
stored dtype). `blaze edit` and `blaze apply` both write through here, so they give the same bytes.
Memory stays at a few row blocks whatever the model size. Every other file is copied byte-for-byte.

The manifest needs the SHA-256 of every input and output file. Inputs whose hash is already known (Hub
cache blob names, blaze's per-file hash cache: `clef_model.filehash`) are not read for it; the others are
hashed from the same memory-mapped windows the copy reads. Output shards are hashed in the same single
pass, on background threads, so hashing overlaps the disk work; the digests of what was written (and of
inputs hashed on the way) are recorded in the hash cache. All of it happens in a temporary sibling folder
that is renamed at the end: an error leaves no partial output and never touches the base.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from clef_model.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    CheckpointReader,
    ShardedWriter,
    atomic_output,
    copy_file,
    copy_range,
    read_header,
    sha256_file,
    shard_name,
)
from clef_model.errors import BlazeError
from clef_model.filehash import known_sha256, record_sha256
from clef_model.outputs import check_separate
from clef_model.release import is_junk
from surgery.delta import PATCH_FILE, BaseMismatchError, PatchArrays, RowBlockUpdate, as_arrays
from surgery.manifest import MANIFEST_FILE, build_manifest, write_manifest

if TYPE_CHECKING:
    from clef_model.release import Release
    from surgery.patch import Patch

_BLOCK_BYTES = 4 * 1024 * 1024  # bytes of stored data per read/compute block of an edited tensor
_BLOCKS_AHEAD = 1  # edited blocks queued to the worker ahead of the one being written
_WINDOW_BYTES = 32 * 1024 * 1024  # bytes per mapped window when copying an untouched tensor
_WINDOWS_IN_FLIGHT = 4  # mapped windows the hash threads may lag behind the copy
_BLAZE_FILES = {PATCH_FILE, MANIFEST_FILE}


class _AsyncSha256:
    """SHA-256 fed from the streaming loop and computed on a background thread (hashlib drops the GIL).

    `update` returns a ticket; `wait(ticket)` blocks until that chunk (and every earlier one) is hashed,
    after which the caller may reuse or unmap its memory.
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=16)
        self._queued = 0
        self._hashed = 0
        self._error: BaseException | None = None
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._digest.update(chunk)
            except BaseException as error:  # noqa: BLE001 - reported by hexdigest; waiters must not hang
                self._error = error
            del chunk
            with self._progress:
                self._hashed += 1
                self._progress.notify_all()

    def update(self, chunk: bytes | memoryview) -> int:
        """Queue a chunk (the caller must not modify it until it is hashed); returns its ticket."""
        self._queue.put(chunk)
        self._queued += 1
        return self._queued

    def wait(self, ticket: int | None = None) -> None:
        """Block until chunk `ticket` (default: every queued chunk) has been hashed."""
        target = self._queued if ticket is None else ticket
        with self._progress:
            self._progress.wait_for(lambda: self._hashed >= target or not self._thread.is_alive())

    def hexdigest(self) -> str:
        """Finish and return the hex digest."""
        self.stop()
        if self._error is not None:
            raise RuntimeError(f"hashing failed: {self._error}") from self._error
        return self._digest.hexdigest()

    def stop(self) -> None:
        """End the thread after the chunks already queued (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class _MappedWindows:
    """Memory-mapped source windows that hash threads may still be reading, unmapped once hashed.

    Keeping up to `depth` windows in flight lets the kernel copy of window i+1 overlap the hashing of
    window i instead of waiting for it; memory stays at `depth` windows of mapped page cache.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self._pending: collections.deque = collections.deque()

    def add(self, mapped: mmap.mmap, view: memoryview, tickets: list[tuple[_AsyncSha256, int]]) -> None:
        """Track a window whose chunks were queued to the hashers under `tickets`; retire the oldest."""
        self._pending.append((mapped, view, tickets))
        while len(self._pending) > self.depth:
            self._retire()

    def _retire(self) -> None:
        mapped, view, tickets = self._pending.popleft()
        for hasher, ticket in tickets:
            hasher.wait(ticket)
        view.release()
        mapped.close()

    def drain(self) -> None:
        """Wait for every window to be hashed and unmap it (also after errors, before the hashers stop)."""
        while self._pending:
            self._retire()


class _HashingFile:
    """A write-only file wrapper that hashes everything written through it."""

    def __init__(self, handle: BinaryIO, hasher: _AsyncSha256) -> None:
        self._handle, self._hasher = handle, hasher

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        return self._handle.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class _HashingWriter(ShardedWriter):
    """ShardedWriter that SHA-256-hashes every shard as it is written (planned layouts only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shard_hashers: list[_AsyncSha256] = []

    def _open_shard(self) -> None:
        super()._open_shard()
        hasher = _AsyncSha256()
        self.shard_hashers.append(hasher)
        # the header was written before the wrapper existed: hash it from the file
        self._handle.flush()
        with open(self._handle.name, "rb") as handle:
            hasher.update(handle.read())
        self._handle = _HashingFile(self._handle, hasher)

    def _file(self) -> BinaryIO:
        return self._handle._handle  # raw copies bypass the wrapper; their bytes are hashed by the caller

    def abort(self) -> None:
        super().abort()
        for hasher in self.shard_hashers:
            hasher.stop()


def _side_files(base: Release, reader: CheckpointReader) -> list[str]:
    """Every non-weight file of the base (relative POSIX names), minus junk (`clef_model.release.is_junk`:
    hidden files, `__pycache__`, editor backups) and a previous variant's blaze files."""
    weights = {p.name for p in reader.shard_files()} | {INDEX_NAME}
    if hasattr(base, "side_files"):
        names = list(base.side_files())
    else:
        root = Path(base.path)
        names = [p.relative_to(root).as_posix() for p in root.rglob("*")
                 if p.is_file() and not is_junk(p.relative_to(root).as_posix())]
    return sorted(n for n in names if n not in weights and n not in _BLAZE_FILES)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    from clef_model.env import quiet

    enabled = enabled and not quiet()
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
                dynamic_ncols=True)


def _edited_blocks(reader: CheckpointReader, name: str, u: np.ndarray, v: np.ndarray,
                   in_hash: _AsyncSha256 | None, stats: dict, bar, pool: ThreadPoolExecutor,
                   known_sha256: str | None = None, expect_sha256: str | None = None) -> Iterator[memoryview]:
    """Raw bytes of W + U Vᵀ, row block by row block (`RowBlockUpdate`: fp32 math, cast to the stored dtype).

    Block i+1 is computed on `pool`'s single worker thread while the caller writes block i (numpy drops the
    GIL in its loops), so the edit's arithmetic overlaps the disk work; one worker keeps the blocks in order
    and the running norms deterministic. The tensor's stored bytes are hashed on a background thread for the
    manifest, unless `known_sha256` already gives that digest; when `expect_sha256` is given and the bytes
    hash to something else, `BaseMismatchError` stops the write (the caller discards the partial output).
    """
    info = reader.info(name)
    rows, cols = info.shape
    update = RowBlockUpdate(u, v, info.dtype)
    row_bytes = cols * update.stored.itemsize
    rows_per_block = max(1, _BLOCK_BYTES // max(1, row_bytes))
    tensor_hash = _AsyncSha256() if known_sha256 is None else None
    pending: collections.deque = collections.deque()

    def finished() -> memoryview:
        future, size = pending.popleft()
        new, block_weight, block_change = future.result()
        # a non-finite change where W was finite = overflow of the stored dtype
        if not math.isfinite(block_change) and math.isfinite(block_weight):
            raise BlazeError(f"editing {name} overflows {info.dtype} (non-finite values); use a smaller strength.")
        bar.update(size)
        return memoryview(new.reshape(-1).view(np.uint8))  # a fresh array: safe to hand to the hash thread

    start = 0
    try:
        for raw in reader.iter_raw(name, chunk_bytes=rows_per_block * row_bytes):
            if in_hash is not None:
                in_hash.update(raw)
            if tensor_hash is not None:
                tensor_hash.update(raw)
            count = len(raw) // row_bytes
            block = np.frombuffer(raw, dtype=update.stored).reshape(count, cols)
            pending.append((pool.submit(update.apply, block, start), len(raw)))
            start += count
            if len(pending) > _BLOCKS_AHEAD:  # blocks computing while an earlier one is written
                yield finished()
        while pending:
            yield finished()
        digest = tensor_hash.hexdigest() if tensor_hash is not None else known_sha256
        assert digest is not None  # tensor_hash exists exactly when known_sha256 is None
    finally:
        for future, _ in pending:
            future.cancel()
        for future, _ in pending:
            if not future.cancelled():
                future.exception()  # wait: the worker must be done with this tensor's buffers
        if tensor_hash is not None:
            tensor_hash.stop()
    if expect_sha256 is not None and digest != expect_sha256:
        raise BaseMismatchError(f"{name} has different values than in the base the patch was made from "
                                f"(SHA-256 {digest[:12]}…, patch made on {expect_sha256[:12]}…); nothing was written.")
    stats["weight_norm"] = update.weight_sq**0.5
    stats["base_sha256"] = digest
    stats["realized_delta_norm"] = update.change_sq**0.5


def _copy_hashed(source, position: int, end: int, out, hashers: list[_AsyncSha256], windows: _MappedWindows,
                 bar) -> None:
    """Copy bytes [position, end) of `source` (a shard open for reading) to the end of `out`, hashing them.

    The kernel copies the bytes (`copy_file_range`) while the hash threads read the same bytes from a
    memory map of the source window — no user-space copy. Windows stay mapped until hashed (`windows`),
    so the copy runs ahead of the hashing by a few windows; the window after the current one is
    requested from the disk (`POSIX_FADV_WILLNEED`) before the current one is copied.
    """
    page = mmap.ALLOCATIONGRANULARITY
    fd = source.fileno()
    while position < end:
        length = min(_WINDOW_BYTES, end - position)
        if position + length < end:
            os.posix_fadvise(fd, position + length, min(_WINDOW_BYTES, end - position - length),
                             os.POSIX_FADV_WILLNEED)
        # the kernel copy reads the window from the disk first, at full sequential speed; the hash
        # threads then read it from the page cache (hashing first would fault it in page by page)
        copy_range(source, position, length, out)
        start = position - position % page
        mapped = mmap.mmap(fd, position - start + length, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED, offset=start)
        view = memoryview(mapped)[position - start:]
        tickets = [(hasher, hasher.update(view)) for hasher in hashers]
        windows.add(mapped, view, tickets)  # unmapped only after every hasher is done with it
        position += length
        bar.update(length)


def _copy_untouched(reader: CheckpointReader, name: str, source, writer: _HashingWriter,
                    in_hash: _AsyncSha256 | None, windows: _MappedWindows, bar) -> None:
    """Copy one tensor bit-identically from `source` (its shard, open for reading) into the writer's shard."""
    info = reader.info(name)
    writer.start_tensor(name, info.dtype, info.shape)
    hashers = [writer.shard_hashers[-1]] + ([in_hash] if in_hash is not None else [])
    _copy_hashed(source, info.offset, info.offset + info.nbytes, writer._file(), hashers, windows, bar)


def _fully_covered(reader: CheckpointReader, shard: Path) -> bool:
    """True when the reader's tensors tile `shard`'s data section exactly (so streaming them hashes the file)."""
    infos = sorted((reader.info(n) for n in reader.names() if reader.info(n).file == shard), key=lambda i: i.offset)
    if not infos:
        return False
    position = infos[0].offset
    _, data_start = read_header(shard)
    if position != data_start:
        return False
    for info in infos:
        if info.offset != position:
            return False
        position += info.nbytes
    return position == shard.stat().st_size


def _input_sha256(path: Path, hashed: dict[Path, str]) -> str:
    """SHA-256 of an input file: the known digest, else hashed now and added to `hashed` (for the cache)."""
    known = known_sha256(path)
    if known is None:
        known = hashed[path] = sha256_file(path)
    return known


def _kept_layout(reader: CheckpointReader, max_shard_bytes: int) -> list[Path] | None:
    """The base's shards, when the variant can keep their layout; None when it must be re-sharded.

    Kept when the base has an index, standard shard names, no shard over the budget and no gaps between
    tensors. Each output shard is then the input shard with the edited tensors' bytes replaced: the same
    name, header and offsets. A shard without edits is byte-identical to the base's, so its SHA-256 is
    the input's (known for Hub downloads and cached files: not read again).
    """
    if reader.index_path is None:
        return None
    shards = reader.shard_files()
    if [p.name for p in shards] != [shard_name(i + 1, len(shards)) for i in range(len(shards))]:
        return None
    sizes: dict[Path, int] = collections.Counter()
    for name in reader.names():
        sizes[reader.info(name).file] += reader.info(name).nbytes
    if any(size > max_shard_bytes for size in sizes.values()):
        return None
    if not all(_fully_covered(reader, shard) for shard in shards):
        return None
    return shards


def _stream_kept_layout(reader: CheckpointReader, shards: list[Path], patch: PatchArrays, folder: Path, bar,
                        stats: dict[str, dict], hashed: dict[Path, str], known_tensor_sha256: Mapping[str, str],
                        expect_tensor_sha256: Mapping[str, str]) -> tuple[dict, dict[str, str], dict[str, str]]:
    """`_stream_weights` for a kept layout (`_kept_layout`): shard by shard, header copied as it is."""
    edited = {f"{n}.weight": n for n in patch.names()}
    in_hashes: dict[str, str] = {}
    out_hashes: dict[str, str] = {}
    by_shard: dict[Path, list] = collections.defaultdict(list)
    for name in reader.names():
        by_shard[reader.info(name).file].append(reader.info(name))
    windows = _MappedWindows(_WINDOWS_IN_FLIGHT)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blaze-edit")  # edited blocks' arithmetic
    hashers: list[_AsyncSha256] = []
    try:
        for shard in shards:
            infos = sorted(by_shard[shard], key=lambda info: info.offset)
            known = known_sha256(shard)
            touched = any(info.name in edited for info in infos)
            with open(shard, "rb") as source, open(folder / shard.name, "wb") as out:
                os.posix_fadvise(source.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                if not touched and known is not None:  # the same bytes as a file whose hash is known
                    copy_range(source, 0, shard.stat().st_size, out)
                    in_hashes[shard.name] = out_hashes[shard.name] = known
                    bar.update(sum(info.nbytes for info in infos))
                    continue
                out_hash = _AsyncSha256()
                # an untouched shard's output hash is its input hash: one hasher serves both
                in_hash = _AsyncSha256() if (known is None and touched) else None
                hashers += [h for h in (out_hash, in_hash) if h is not None]
                both = [out_hash] + ([in_hash] if in_hash is not None else [])
                header = source.read(infos[0].offset)
                out.write(header)
                for hasher in both:
                    hasher.update(header)
                for info in infos:
                    if info.name not in edited:
                        _copy_hashed(source, info.offset, info.offset + info.nbytes, out, both, windows, bar)
                        continue
                    base = edited[info.name]
                    u, v = patch.factors[base]
                    stats[base] = {}
                    for block in _edited_blocks(reader, info.name, u, v, in_hash, stats[base], bar, pool,
                                                known_tensor_sha256.get(base), expect_tensor_sha256.get(base)):
                        out_hash.update(block)
                        out.write(block)
                windows.drain()
            out_hashes[shard.name] = out_hash.hexdigest()
            if not touched:
                in_hashes[shard.name] = hashed[shard] = out_hashes[shard.name]
            elif in_hash is not None:
                in_hashes[shard.name] = hashed[shard] = in_hash.hexdigest()
            else:
                assert known is not None  # touched with no input hasher: its hash was known
                in_hashes[shard.name] = known
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        windows.drain()  # the hash threads must be done with every window before it is unmapped
        for hasher in hashers:
            hasher.stop()
    total = sum(reader.info(name).nbytes for name in reader.names())
    index = {"metadata": {"total_size": total},
             "weight_map": {name: reader.info(name).file.name for name in sorted(reader.names())}}
    index_path = folder / INDEX_NAME
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    assert reader.index_path is not None  # _kept_layout keeps only indexed bases
    in_hashes[INDEX_NAME] = _input_sha256(reader.index_path, hashed)
    out_hashes[INDEX_NAME] = sha256_file(index_path)
    return index, in_hashes, out_hashes


def _stream_weights(reader: CheckpointReader, patch: PatchArrays, folder: Path, max_shard_bytes: int, bar,
                    stats: dict[str, dict], hashed: dict[Path, str], known_tensor_sha256: Mapping[str, str],
                    expect_tensor_sha256: Mapping[str, str]) -> tuple[dict, dict[str, str], dict[str, str]]:
    """Write all shards + index; returns (index, input file hashes, output file hashes).

    An input whose SHA-256 is already known (`clef_model.filehash.known_sha256`) is not hashed again; the
    inputs hashed here are added to `hashed` (path -> digest) for the hash cache.
    """
    edited = {f"{n}.weight": n for n in patch.names()}
    layout = [(n, reader.dtype(n), reader.shape(n)) for n in reader.names()]
    in_hashes: dict[str, str] = {}
    in_hashers: dict[Path, _AsyncSha256 | None] = {}
    writer = _HashingWriter(folder, max_shard_bytes=max_shard_bytes, layout=layout)
    windows = _MappedWindows(_WINDOWS_IN_FLIGHT)
    sources: dict[Path, BinaryIO] = {}  # one open handle per input shard: the kernel's readahead stays sequential
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blaze-edit")  # edited blocks' arithmetic
    try:
        with writer:
            for name in reader.names():
                shard = reader.info(name).file
                if shard not in in_hashers:
                    known = known_sha256(shard)
                    if known is not None:
                        in_hashes[shard.name] = known
                        in_hashers[shard] = None
                    elif _fully_covered(reader, shard):
                        header_hasher = _AsyncSha256()
                        with open(shard, "rb") as header_file:
                            header_hasher.update(header_file.read(reader.info(name).offset))  # the header
                        in_hashers[shard] = header_hasher
                    else:
                        in_hashes[shard.name] = hashed[shard] = sha256_file(shard)
                        in_hashers[shard] = None
                hasher = in_hashers[shard]
                if name in edited:
                    u, v = patch.factors[edited[name]]
                    stats[edited[name]] = {}
                    chunks: Iterable = _edited_blocks(reader, name, u, v, hasher, stats[edited[name]], bar, pool,
                                                      known_tensor_sha256.get(edited[name]),
                                                      expect_tensor_sha256.get(edited[name]))
                    writer.add_raw(name, reader.dtype(name), reader.shape(name), chunks)
                else:
                    if shard not in sources:
                        sources[shard] = open(shard, "rb")  # noqa: SIM115 - closed in the finally below
                        os.posix_fadvise(sources[shard].fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    _copy_untouched(reader, name, sources[shard], writer, hasher, windows, bar)
            windows.drain()
            index = writer.close()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        windows.drain()  # the hash threads must be done with every window before it is unmapped
        for handle in sources.values():
            handle.close()
        for hasher in in_hashers.values():
            if hasher is not None:
                hasher.stop()
    for shard, hasher in in_hashers.items():
        if hasher is not None:
            in_hashes[shard.name] = hashed[shard] = hasher.hexdigest()
    if reader.index_path is not None:
        in_hashes[INDEX_NAME] = _input_sha256(reader.index_path, hashed)
    shard_files = writer.files[:-1]  # the writer's files end with the index, hashed just below
    out_hashes = {path.name: hasher.hexdigest() for path, hasher in zip(shard_files, writer.shard_hashers, strict=True)}
    out_hashes[INDEX_NAME] = sha256_file(folder / INDEX_NAME)
    return index, in_hashes, out_hashes


def write_variant(
    base: Release,
    patch: PatchArrays | Patch,
    out: Path,
    *,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    manifest_extra: dict | None = None,
    progress: bool = True,
    extra_files: dict[str, bytes] | Callable[[Path], dict[str, bytes]] | None = None,
    known_tensor_sha256: Mapping[str, str] | None = None,
    expect_tensor_sha256: Mapping[str, str] | None = None,
) -> Path:
    """Write base + patch as a drop-in release folder at `out` and return its path.

    `base` is a `clef_model.release.Release` (needs `path`, `ref`, `revision`; `side_files()` is used when
    present). `patch` is a `surgery.delta.PatchArrays` or a torch `surgery.patch.Patch` (viewed as arrays;
    the same bytes either way). The patch is checked against the base first (every NAME.weight exists with
    U·Vᵀ's shape), so a misfit raises BlazeError before anything is written. `manifest_extra` (behaviour
    spec hash, targets, method, α, k, λ, seeds, …) goes into the manifest's "edit" section. The digests of
    the files written, and of the inputs hashed on the way, are recorded in blaze's hash cache
    (`clef_model.filehash`) once the folder is in place. `known_tensor_sha256` (NAME -> SHA-256 of the
    base's stored NAME.weight), when the caller has just computed it (`surgery.delta.check_identity`),
    spares hashing the edited tensors a second time. `expect_tensor_sha256` (NAME -> the digest recorded in
    the patch's base identity) is checked as each edited tensor streams by: the first tensor whose stored
    bytes differ raises `surgery.delta.BaseMismatchError` and nothing is written. This is how `blaze apply`
    verifies the base without reading the edited tensors twice.
    """
    started_ns = time.time_ns()
    patch = as_arrays(patch)
    base_path = Path(base.path)
    out = Path(out)
    check_separate(out, base_path, "the base")
    reader = CheckpointReader(base_path)
    patch.check_fits(reader)
    side = _side_files(base, reader)
    missing = [n for n in side if not (base_path / n).is_file()]
    if missing:
        raise BlazeError(f"{base_path}: listed file {missing[0]!r} is missing; the base release is incomplete.")
    side_bytes = sum((base_path / n).stat().st_size for n in side)
    weights = {p.name for p in reader.shard_files()} | {INDEX_NAME}
    def _check_extra_names(names) -> None:
        for name in names:
            if ("/" in name or name in side or name in _BLAZE_FILES or name in weights or name.startswith(".")
                    or (name.startswith("model") and name.endswith(".safetensors"))):
                raise BlazeError(f"extra file name {name!r} would clash with a release file; choose another name.")

    if not callable(extra_files):
        _check_extra_names(extra_files or {})  # checked before anything is written

    with atomic_output(out, force=force) as tmp, \
            _progress(reader.total_bytes() + side_bytes, progress, f"writing {out.name}") as bar:
        stats: dict[str, dict] = {}
        hashed: dict[Path, str] = {}  # inputs hashed here (for the hash cache)
        shards = _kept_layout(reader, int(max_shard_bytes))
        if shards is not None:
            index, in_hashes, out_hashes = _stream_kept_layout(reader, shards, patch, tmp, bar, stats, hashed,
                                                               dict(known_tensor_sha256 or {}),
                                                               dict(expect_tensor_sha256 or {}))
        else:
            index, in_hashes, out_hashes = _stream_weights(reader, patch, tmp, int(max_shard_bytes), bar, stats,
                                                           hashed, dict(known_tensor_sha256 or {}),
                                                           dict(expect_tensor_sha256 or {}))
        for name in side:
            copy_file(base_path / name, tmp / name)
            digest = known_sha256(base_path / name)
            if digest is None:  # hash the fresh copy (same bytes, still in the page cache)
                digest = hashed[base_path / name] = sha256_file(tmp / name)
            in_hashes[name] = out_hashes[name] = digest
            bar.update((base_path / name).stat().st_size)
        patch.save(tmp / PATCH_FILE)
        out_hashes[PATCH_FILE] = sha256_file(tmp / PATCH_FILE)
        # extra_files: minimal addition by the build engineer (blaze edit stores blaze_canary.json/.md here,
        # so the report is listed and hashed in the manifest before the folder is finalised).
        # a callable gets the finished (not yet renamed) folder, e.g. to check its integrity for the report
        if callable(extra_files):
            extra_files = extra_files(tmp)
            _check_extra_names(extra_files)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
            out_hashes[name] = sha256_file(tmp / name)

        matrices = {}
        for name in patch.names():
            weight = f"{name}.weight"
            delta_norm = patch.delta_norm(name)
            weight_norm = stats[name]["weight_norm"]
            matrices[name] = {
                "shape": list(reader.shape(weight)),
                "dtype": reader.dtype(weight),
                "k": patch.rank(name),
                "numerical_rank": patch.numerical_rank(name),
                "delta_norm": delta_norm,
                "weight_norm": weight_norm,
                "relative_change": delta_norm / weight_norm if weight_norm else None,
                "realized_relative_change": stats[name]["realized_delta_norm"] / weight_norm if weight_norm else None,
            }
        manifest = build_manifest(
            base={
                "ref": str(getattr(base, "ref", base_path)),
                "revision": getattr(base, "revision", None),
                "total_size": reader.total_bytes(),
                "files": dict(sorted(in_hashes.items())),
                # the same keys as surgery.patch.base_identity, so checks can compare a base against either
                "index_file": INDEX_NAME if reader.index_path is not None else reader.shard_files()[0].name,
                "index_sha256": in_hashes.get(INDEX_NAME) if reader.index_path is not None else None,
                "tensor_sha256": {name: stats[name]["base_sha256"] for name in patch.names()},
            },
            patch_file=PATCH_FILE,
            patch_metadata=patch.metadata,
            base_identity=patch.base_identity,
            edit=manifest_extra,
            matrices=matrices,
            output_files=out_hashes,
            output_total_size=index["metadata"]["total_size"],
            edited_tensors=[f"{name}.weight" for name in patch.names()],
        )
        write_manifest(tmp / MANIFEST_FILE, manifest)
        for path in tmp.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    record_sha256(hashed, hashed_ns=started_ns)
    record_sha256({out / name: digest for name, digest in out_hashes.items()})
    return out
