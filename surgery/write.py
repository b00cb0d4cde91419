"""Streaming execute: base checkpoint + patch -> a drop-in variant folder (no model, no GPU).

Every tensor of the base is streamed to new shards in on-disk order: untouched tensors as raw bytes
(bit-identical, never through a dtype round trip), edited ones row block by row block as W + U Vᵀ in fp32,
cast back to the stored dtype. Memory stays at a few row blocks whatever the model size. Every other file
is copied byte-for-byte. Input and output files are SHA-256-hashed while they stream (in background
threads, so hashing overlaps the disk work) for the manifest. All of it happens in a temporary sibling
folder that is renamed at the end: an error leaves no partial output and never touches the base.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from clef_model.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    CheckpointReader,
    ShardedWriter,
    atomic_output,
    copy_file,
    sha256_file,
    tensor_to_bytes,
    torch_dtype,
)
from clef_model.errors import BlazeError
from surgery.manifest import MANIFEST_FILE, build_manifest, write_manifest
from surgery.patch import PATCH_FILE, Patch

_BLOCK_BYTES = 4 * 1024 * 1024  # bytes of stored data per read/compute block of an edited tensor
_WINDOW_BYTES = 32 * 1024 * 1024  # bytes per mapped window when copying an untouched tensor
_BLAZE_FILES = {PATCH_FILE, MANIFEST_FILE}


class _AsyncSha256:
    """SHA-256 fed from the streaming loop and computed on a background thread (hashlib drops the GIL)."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._digest.update(chunk)
            del chunk
            self._queue.task_done()
        self._queue.task_done()

    def wait(self) -> None:
        """Block until every queued chunk has been hashed (after which the caller may reuse its memory)."""
        self._queue.join()

    def update(self, chunk) -> None:
        """Queue a chunk; the caller must not modify it afterwards."""
        self._queue.put(chunk)

    def hexdigest(self) -> str:
        """Finish and return the hex digest."""
        self.stop()
        return self._digest.hexdigest()

    def stop(self) -> None:
        """End the thread (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class _HashingFile:
    """A write-only file wrapper that hashes everything written through it."""

    def __init__(self, handle, hasher: _AsyncSha256):
        self._handle, self._hasher = handle, hasher

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        return self._handle.write(view)

    def __getattr__(self, name):
        return getattr(self._handle, name)


class _HashingWriter(ShardedWriter):
    """ShardedWriter that SHA-256-hashes every shard as it is written (planned layouts only)."""

    def __init__(self, *args, **kwargs):
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

    def _file(self):
        return self._handle._handle  # raw copies bypass the wrapper; their bytes are hashed by the caller

    def abort(self) -> None:
        super().abort()
        for hasher in self.shard_hashers:
            hasher.stop()


def _side_files(base, reader: CheckpointReader) -> list[str]:
    """Every non-weight file of the base (relative POSIX names), minus a previous variant's blaze files."""
    weights = {p.name for p in reader.shard_files()} | {INDEX_NAME}
    if hasattr(base, "side_files"):
        names = list(base.side_files())
    else:
        root = Path(base.path)
        names = [p.relative_to(root).as_posix() for p in root.rglob("*")
                 if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(n for n in names if n not in weights and n not in _BLAZE_FILES)


def _check_paths(base_path: Path, out: Path) -> None:
    base_real, out_real = base_path.resolve(), out.resolve()
    if out_real == base_real or out_real in base_real.parents or base_real in out_real.parents:
        raise BlazeError(f"the output {out} overlaps the base {base_path}; write the variant to a separate folder.")


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    enabled = enabled and os.environ.get("BLAZE_QUIET") != "1"
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
                dynamic_ncols=True)


def _edited_blocks(reader: CheckpointReader, name: str, u: torch.Tensor, v: torch.Tensor,
                   in_hash: _AsyncSha256 | None, stats: dict, bar) -> Iterator[memoryview]:
    """Raw bytes of W + U Vᵀ, row block by row block (fp32 math, cast to the stored dtype)."""
    info = reader.info(name)
    dtype = torch_dtype(info.dtype)
    rows, cols = info.shape
    row_bytes = cols * dtype.itemsize
    rows_per_block = max(1, _BLOCK_BYTES // max(1, row_bytes))
    vt = v.T.contiguous()
    weight_sq = change_sq = 0.0
    start = 0
    tensor_hash = hashlib.sha256()
    for raw in reader.iter_raw(name, chunk_bytes=rows_per_block * row_bytes):
        if in_hash is not None:
            in_hash.update(raw)
        tensor_hash.update(raw)
        count = len(raw) // row_bytes
        old32 = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(count, cols).float()
        new = torch.addmm(old32, u[start : start + count], vt).to(dtype)
        # squared norms by BLAS dot products (cheap); a non-finite change where W was finite = overflow
        flat, diff = old32.view(-1), new.float().sub_(old32).view(-1)
        block_weight, block_change = float(torch.dot(flat, flat)), float(torch.dot(diff, diff))
        if not math.isfinite(block_change) and math.isfinite(block_weight):
            raise BlazeError(f"editing {name} overflows {info.dtype} (non-finite values); use a smaller strength.")
        weight_sq += block_weight
        change_sq += block_change
        del old32, flat, diff
        start += count
        bar.update(len(raw))
        yield tensor_to_bytes(new)
    stats["weight_norm"] = weight_sq**0.5
    stats["base_sha256"] = tensor_hash.hexdigest()
    stats["realized_delta_norm"] = change_sq**0.5


def _copy_untouched(reader: CheckpointReader, name: str, writer: "_HashingWriter",
                    in_hash: _AsyncSha256 | None, bar) -> None:
    """Copy one tensor bit-identically: the kernel copies the bytes (`copy_file_range`) while both hash
    threads read the same bytes from a memory map of the source window — no user-space copy, and the
    mapping is dropped after each window, so memory stays at one window."""
    info = reader.info(name)
    writer.start_tensor(name, info.dtype, info.shape)
    out_hash = writer.shard_hashers[-1]
    page = mmap.ALLOCATIONGRANULARITY
    with open(info.file, "rb") as handle:
        position, end = info.offset, info.offset + info.nbytes
        while position < end:
            length = min(_WINDOW_BYTES, end - position)
            start = position - position % page
            mapped = mmap.mmap(handle.fileno(), position - start + length, prot=mmap.PROT_READ,
                               flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), offset=start)
            view = memoryview(mapped)[position - start:]
            try:
                if in_hash is not None:
                    in_hash.update(view)
                out_hash.update(view)
                writer.write_range(info.file, position, length)
            finally:
                # the hash threads must be done with the window before it is unmapped, also on errors
                if in_hash is not None:
                    in_hash.wait()
                out_hash.wait()
                view.release()
                mapped.close()
            position += length
            bar.update(length)


def _fully_covered(reader: CheckpointReader, shard: Path) -> bool:
    """True when the reader's tensors tile `shard`'s data section exactly (so streaming them hashes the file)."""
    infos = sorted((reader.info(n) for n in reader.names() if reader.info(n).file == shard), key=lambda i: i.offset)
    if not infos:
        return False
    position = infos[0].offset
    from clef_model.checkpoint import read_header

    _, data_start = read_header(shard)
    if position != data_start:
        return False
    for info in infos:
        if info.offset != position:
            return False
        position += info.nbytes
    return position == shard.stat().st_size


def _stream_weights(reader: CheckpointReader, patch: Patch, folder: Path, max_shard_bytes: int, bar,
                    stats: dict[str, dict]) -> tuple[dict, dict[str, str], dict[str, str]]:
    """Write all shards + index; returns (index, input file hashes, output file hashes)."""
    edited = {f"{n}.weight": n for n in patch.names()}
    layout = [(n, reader.dtype(n), reader.shape(n)) for n in reader.names()]
    in_hashes: dict[str, str] = {}
    in_hashers: dict[Path, _AsyncSha256] = {}
    writer = _HashingWriter(folder, max_shard_bytes=max_shard_bytes, layout=layout)
    try:
        with writer:
            for name in reader.names():
                shard = reader.info(name).file
                if shard not in in_hashers:
                    if _fully_covered(reader, shard):
                        hasher = _AsyncSha256()
                        with open(shard, "rb") as handle:
                            hasher.update(handle.read(reader.info(name).offset))  # the header
                        in_hashers[shard] = hasher
                    else:
                        in_hashes[shard.name] = sha256_file(shard)
                        in_hashers[shard] = None
                hasher = in_hashers[shard]
                if name in edited:
                    u, v = patch.factors[edited[name]]
                    stats[edited[name]] = {}
                    chunks: Iterable = _edited_blocks(reader, name, u, v, hasher, stats[edited[name]], bar)
                    writer.add_raw(name, reader.dtype(name), reader.shape(name), chunks)
                else:
                    _copy_untouched(reader, name, writer, hasher, bar)
            index = writer.close()
    finally:
        for hasher in in_hashers.values():
            if hasher is not None:
                hasher.stop()
    for shard, hasher in in_hashers.items():
        if hasher is not None:
            in_hashes[shard.name] = hasher.hexdigest()
    if reader.index_path is not None:
        in_hashes[INDEX_NAME] = sha256_file(reader.index_path)
    out_hashes = {path.name: hasher.hexdigest() for path, hasher in zip(writer.files, writer.shard_hashers)}
    out_hashes[INDEX_NAME] = sha256_file(folder / INDEX_NAME)
    return index, in_hashes, out_hashes


def write_variant(
    base,
    patch: Patch,
    out: Path,
    *,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    manifest_extra: dict | None = None,
    progress: bool = True,
    extra_files: "dict[str, bytes] | Callable[[Path], dict[str, bytes]] | None" = None,
) -> Path:
    """Write base + patch as a drop-in release folder at `out` and return its path.

    `base` is a `clef_model.release.Release` (needs `path`, `ref`, `revision`; `side_files()` is used when
    present). The patch is checked against the base first (every NAME.weight exists with U·Vᵀ's shape),
    so a misfit raises BlazeError before anything is written. `manifest_extra` (behaviour spec hash,
    targets, method, α, k, λ, seeds, …) goes into the manifest's "edit" section.
    """
    base_path = Path(base.path)
    out = Path(out)
    _check_paths(base_path, out)
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
        index, in_hashes, out_hashes = _stream_weights(reader, patch, tmp, int(max_shard_bytes), bar, stats)
        for name in side:
            copy_file(base_path / name, tmp / name)
            digest = sha256_file(tmp / name)
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
        )
        manifest["edited_tensors"] = [f"{name}.weight" for name in patch.names()]
        write_manifest(tmp / MANIFEST_FILE, manifest)
        for path in tmp.rglob("*"):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return out
