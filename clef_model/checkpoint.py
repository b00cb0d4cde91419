"""All safetensors I/O of blaze: a lazy per-tensor reader, a streaming sharded writer, atomic output folders.

Why hand-written rather than `safetensors.torch.save_file`: `save_file` needs every tensor of a shard in
memory at once (it builds the header from the full dict), so writing a 5 GB shard of a 19 GB checkpoint
would cost 5 GB of RAM, and an untouched bf16 tensor would have to be materialised as a torch tensor. The
format is simple — an 8-byte little-endian header length, a JSON header (`dtype`, `shape`, `data_offsets`
relative to the data section, optional `__metadata__` of strings, padded with spaces), then the raw
little-endian bytes — so this module writes it directly: headers are computed from a planned layout (or,
without a plan, prepended once the shard is complete), and tensors are copied as raw bytes with the
kernel's `copy_file_range`, never through a dtype round trip.

torch is imported only by the functions that take or return torch tensors (`tensor`, `add_tensor`,
`save_tensors`/`load_tensors` of torch tensors, `dtype_name`, `torch_dtype`): reading headers, raw bytes
and numpy arrays (`CheckpointReader.array`, `numpy_dtype`), streaming writes and hashing stay torch-free,
so `blaze apply` runs without loading torch (≈ 700 MiB of memory for the CUDA build).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import math
import os
import shutil
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, cast

if TYPE_CHECKING:  # torch and numpy stay lazy imports at run time
    import numpy as np
    import torch
    from numpy.typing import DTypeLike

from clef_model.errors import BlazeError, ReleaseError
from clef_model.files import INDEX_FILE, SINGLE_FILE
from clef_model.outputs import atomic_output  # noqa: F401 - re-exported: every writer's import point

_Bytes = bytes | bytearray | memoryview  # a bytes-like chunk of tensor data

INDEX_NAME = INDEX_FILE  # (names kept: every reader imports them from here)
SINGLE_NAME = SINGLE_FILE
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit safetensors itself enforces
_COPY_CHUNK = 16 * 1024 * 1024

# safetensors dtype string -> bytes per element
ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "U32": 4, "U64": 8,
}
# safetensors dtype string -> attribute naming the same type in torch and numpy (bf16 / fp8: in ml_dtypes)
_TORCH_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32", "U64": "uint64",
}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def dtype_name(dtype: torch.dtype | DTypeLike) -> str:
    """The safetensors dtype string of a torch or numpy dtype (e.g. torch.bfloat16 -> "BF16")."""
    if not type(dtype).__module__.startswith("torch"):
        return numpy_dtype_name(cast("DTypeLike", dtype))
    import torch

    for name, attr in _TORCH_NAMES.items():
        if getattr(torch, attr) == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be stored in safetensors")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype string (e.g. "BF16" -> torch.bfloat16); imports torch."""
    import torch

    return getattr(torch, _TORCH_NAMES[name])


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype string, little-endian (bfloat16 / float8 from `ml_dtypes`)."""
    import numpy as np

    if name in _ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            raise BlazeError(
                f"reading {name} tensors without torch needs the package ml_dtypes (a blaze dependency); "
                "install it with `pip install 'ml_dtypes>=0.5'`."
            ) from None

        return np.dtype(getattr(ml_dtypes, _ML_DTYPES[name]))
    return np.dtype(_TORCH_NAMES[name]).newbyteorder("<")


def numpy_dtype_name(dtype: DTypeLike) -> str:
    """The safetensors dtype string of a numpy dtype (e.g. ml_dtypes.bfloat16 -> "BF16")."""
    import numpy as np

    dtype = np.dtype(dtype)
    for name in ITEMSIZE:
        candidate = numpy_dtype(name)
        if dtype == candidate or (dtype.newbyteorder("<") == candidate and dtype.byteorder in "=|<"):
            return name
    raise ValueError(f"dtype {dtype} cannot be stored in safetensors")


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of this safetensors dtype and shape occupies on disk."""
    return math.prod(shape) * ITEMSIZE[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard file, dtype, shape and absolute byte range in the file."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute offset of the first data byte in `file`
    nbytes: int


def _plain_shard_name(name: object) -> bool:
    """Whether an index entry is a relative path without `..`, so it names a file of the release folder itself.
    (Not resolved: a Hugging Face snapshot's shards are symlinks into its blob store, which is fine.)"""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    return not Path(name).is_absolute() and ".." not in Path(name).parts


def read_header(path: Path) -> tuple[dict, int]:
    """Parse one safetensors file's header without reading its data; returns (header, data start offset).

    Raises ReleaseError naming the file when the header is unreadable or the file is truncated.
    """
    path = Path(path)

    def corrupt(why: str) -> ReleaseError:
        return ReleaseError(
            f"{path}: not a valid safetensors file ({why}). The file is corrupt or incomplete; "
            "re-download or rebuild it."
        )

    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise corrupt(f"only {size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise corrupt(f"header length {header_len} does not fit a file of {size} bytes")
            raw = handle.read(header_len)
    except OSError as error:
        raise ReleaseError(f"{path}: cannot be read ({error.strerror}); check the path and permissions.") from error
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested past Python's stack
        raise corrupt(f"header is not JSON: {type(error).__name__}: {str(error)[:200]}") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")
    data_start = 8 + header_len
    data_size = size - data_start
    for name, entry in header.items():
        why = _header_entry_problem(name, entry, data_size)
        if why is not None:
            raise corrupt(why)
    why = _overlap_problem(header)
    if why is not None:
        raise corrupt(why)
    return header, data_start


def _overlap_problem(header: dict) -> str | None:
    """Two tensors whose data ranges overlap (the safetensors format forbids it: one byte would be two tensors')."""
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], name) for name, entry in header.items()
                   if name != "__metadata__" and entry["data_offsets"][1] > entry["data_offsets"][0])
    for (_b0, end0, first), (begin1, _e1, second) in itertools.pairwise(spans):  # sorted: neighbours suffice
        if begin1 < end0:
            return f"tensors {first!r} and {second!r} share bytes (data offsets overlap)"
    return None


def _header_entry_problem(name: str, entry: Any, data_size: int) -> str | None:
    """What is wrong with one entry of a safetensors header (None: nothing), given the data section's size."""
    if name == "__metadata__":
        return "__metadata__ is not an object" if entry is not None and not isinstance(entry, dict) else None
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        return f"entry {name!r} lacks dtype/shape/data_offsets"
    if dtype not in ITEMSIZE:
        return f"tensor {name!r} has unknown dtype {dtype!r}"
    if not all(isinstance(dim, int) and dim >= 0 for dim in shape):
        return f"tensor {name!r} has a bad shape {list(shape)}"
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        return f"tensor {name!r} has bad data offsets {[begin, end]}"
    if end - begin != tensor_nbytes(dtype, shape):
        return f"tensor {name!r}: {end - begin} bytes for {dtype}{list(shape)}"
    if end > data_size:
        return f"truncated: tensor {name!r} ends at byte {end} of a {data_size}-byte data section"
    return None


class CheckpointReader:
    """Lazy, per-tensor access to a safetensors checkpoint (a sharded folder, a single-file folder, or a file).

    Only headers are parsed at construction (which also validates them: a truncated shard or a bad header
    raises ReleaseError at once); tensor data is read on request, one tensor at a time.
    """

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.folder = folder
        self.index_path: Path | None = None
        if folder.is_file():
            files = {folder.name: folder}
            wanted: dict[str, str] | None = None
            self.folder = folder.parent
        elif (folder / INDEX_NAME).is_file():
            self.index_path = folder / INDEX_NAME
            try:
                index = json.loads(self.index_path.read_text(encoding="utf-8"))
                wanted = dict(index["weight_map"])
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
                raise ReleaseError(
                    f"{self.index_path}: unreadable checkpoint index ({error}); re-download the release."
                ) from None
            files = {}
            for shard in sorted(set(wanted.values())):
                if not _plain_shard_name(shard):
                    raise ReleaseError(
                        f"{self.index_path}: the index names shard {shard!r}, outside the release folder; a "
                        "checkpoint's shards are files of its own folder. Re-download the release."
                    )
                if not (folder / shard).is_file():
                    raise ReleaseError(
                        f"{folder}: the index names shard {shard!r}, which is missing; re-download the release."
                    )
                files[shard] = folder / shard
        elif (folder / SINGLE_NAME).is_file():
            files = {SINGLE_NAME: folder / SINGLE_NAME}
            wanted = None
        else:
            raise ReleaseError(
                f"{folder}: no {INDEX_NAME} or {SINGLE_NAME} found; point at a folder holding a safetensors checkpoint."
            )

        self._infos: dict[str, TensorInfo] = {}
        self._metadata: dict[str, dict[str, str]] = {}
        for shard, path in files.items():
            header, data_start = read_header(path)
            self._metadata[shard] = dict(header.get("__metadata__") or {})
            for name, entry in header.items():
                if name == "__metadata__" or (wanted is not None and wanted.get(name) != shard):
                    continue
                begin, end = entry["data_offsets"]
                self._infos[name] = TensorInfo(
                    name, path, entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin
                )
        if wanted is not None:
            missing = sorted(set(wanted) - set(self._infos))
            if missing:
                raise ReleaseError(
                    f"{folder}: the index lists {len(missing)} tensor(s) absent from their shard "
                    f"(first: {missing[0]!r}); the checkpoint is inconsistent, re-download it."
                )
        # on-disk order (shard, offset): streaming in this order reads every file sequentially
        self._order = sorted(self._infos, key=lambda n: (self._infos[n].file.name, self._infos[n].offset))

    def names(self) -> list[str]:
        """Every tensor name, in on-disk order (shard by shard, by offset)."""
        return list(self._order)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """Shard file, dtype, shape and byte range of one tensor."""
        try:
            return self._infos[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.folder}") from None

    def dtype(self, name: str) -> str:
        """The safetensors dtype string of a tensor (e.g. "BF16")."""
        return self.info(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of a tensor."""
        return self.info(name).shape

    def nbytes(self, name: str) -> int:
        """The size of a tensor's data in bytes."""
        return self.info(name).nbytes

    def shard_files(self) -> list[Path]:
        """The weight files of this checkpoint (shards, or the single file)."""
        return sorted({info.file for info in self._infos.values()}, key=lambda p: p.name) or [
            self.folder / name for name in self._metadata
        ]

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file name."""
        return {name: self._infos[name].file.name for name in self._order}

    def shard_metadata(self, shard: str) -> dict[str, str]:
        """The `__metadata__` of one shard file (by file name)."""
        return dict(self._metadata[shard])

    def total_bytes(self) -> int:
        """Sum of all tensors' data sizes (the index's `total_size`)."""
        return sum(info.nbytes for info in self._infos.values())

    def iter_raw(self, name: str, chunk_bytes: int = _COPY_CHUNK) -> Iterator[bytes]:
        """A tensor's raw bytes in chunks of at most `chunk_bytes` (bounded memory for huge tensors)."""
        info = self.info(name)
        with open(info.file, "rb") as handle:
            handle.seek(info.offset)
            left = info.nbytes
            while left:
                chunk = handle.read(min(chunk_bytes, left))
                if not chunk:
                    raise ReleaseError(f"{info.file}: ended early while reading {name!r}; the file is truncated.")
                left -= len(chunk)
                yield chunk

    def raw_bytes(self, name: str) -> bytes:
        """A tensor's raw little-endian bytes exactly as stored (no dtype conversion)."""
        info = self.info(name)
        with open(info.file, "rb") as handle:
            handle.seek(info.offset)
            data = handle.read(info.nbytes)
        if len(data) != info.nbytes:
            raise ReleaseError(f"{info.file}: ended early while reading {name!r}; the file is truncated.")
        return data

    def _read_into(self, info: TensorInfo, buffer: bytearray) -> None:
        with open(info.file, "rb") as handle:
            handle.seek(info.offset)
            if handle.readinto(buffer) != info.nbytes:
                raise ReleaseError(f"{info.file}: ended early while reading {info.name!r}; the file is truncated.")

    def array(self, name: str) -> np.ndarray:
        """Load just this tensor as a numpy array in its stored dtype (torch-free; bf16 via ml_dtypes)."""
        import numpy as np

        info = self.info(name)
        buffer = bytearray(info.nbytes)
        if info.nbytes:
            self._read_into(info, buffer)
        return np.frombuffer(buffer, dtype=numpy_dtype(info.dtype)).reshape(info.shape)

    def tensor(self, name: str) -> torch.Tensor:
        """Load just this tensor as a torch tensor, in its stored dtype, on the CPU (imports torch)."""
        import torch

        info = self.info(name)
        dtype = torch_dtype(info.dtype)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        buffer = bytearray(info.nbytes)
        self._read_into(info, buffer)
        return torch.frombuffer(buffer, dtype=dtype).reshape(info.shape)


def tensor_to_bytes(tensor: torch.Tensor | np.ndarray) -> memoryview:
    """A CPU torch tensor's or numpy array's raw bytes in row-major order (a view, no dtype conversion)."""
    if not type(tensor).__module__.startswith("torch"):
        import numpy as np

        array = np.ascontiguousarray(tensor)
        return array.reshape(-1).view(np.uint8).data.cast("B") if array.size else memoryview(b"")
    import torch

    flat = cast(torch.Tensor, tensor).detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def copy_range(src: str | os.PathLike[str] | BinaryIO, offset: int, nbytes: int, dst: BinaryIO) -> None:
    """Copy `nbytes` from `src` at `offset` to the current position of open file `dst`, in the kernel if possible.

    `src` is a path, or a file opened for binary reading (kept open by the caller across many ranges, so
    the kernel's readahead keeps its sequential state; its position is not used).
    """
    if isinstance(src, (str, os.PathLike)):
        with open(src, "rb") as source:
            copy_range(source, offset, nbytes, dst)
        return
    handle, name = src, getattr(src, "name", "the source")
    dst.flush()
    out_fd = dst.fileno()
    in_fd = handle.fileno()
    left, pos = nbytes, offset
    try:
        while left:
            done = os.copy_file_range(in_fd, out_fd, min(left, 1 << 30), pos)
            if done == 0:
                raise ReleaseError(f"{name}: ended early while copying; the file is truncated.")
            left -= done
            pos += done
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise
        handle.seek(pos)
        while left:
            chunk = handle.read(min(_COPY_CHUNK, left))
            if not chunk:
                raise ReleaseError(f"{name}: ended early while copying; the file is truncated.") from None
            dst.write(chunk)
            left -= len(chunk)
        dst.flush()
    dst.seek(0, os.SEEK_END)


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """Serialise a header (8-byte length + JSON padded with spaces to a multiple of 8) for tensors in order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def shard_name(index: int, count: int) -> str:
    """The standard shard file name, e.g. model-00001-of-00004.safetensors (index from 1)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(
    layout: Sequence[tuple[str, str, Sequence[int]]], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[list[tuple[str, str, tuple[int, ...], int]]]:
    """Split (name, dtype, shape) entries, in order, into shards of at most `max_shard_bytes` of data each.

    A tensor larger than the budget gets a shard of its own.
    """
    shards: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
    size = 0
    for name, dtype, shape in layout:
        nbytes = tensor_nbytes(dtype, shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dtype, tuple(shape), nbytes))
        size += nbytes
    return shards if shards[0] else []


class ShardedWriter:
    """Streaming safetensors writer: one tensor at a time, a byte budget per shard, standard names + index.

    With `layout` (every (name, dtype, shape) in the order they will be added) the shard split and each
    header are known in advance, so each tensor goes straight to its final place on disk. Without it the
    writer spools each shard's data to a side file and prepends the header when the shard is complete
    (one extra sequential copy). Either way memory use is one chunk, not one shard. Output files get mode
    0644; shard metadata holds only `format: pt` plus `metadata` (no timestamps: runs are byte-identical).
    """

    def __init__(
        self,
        folder: Path,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: dict | None = None,
        *,
        layout: Sequence[tuple[str, str, Sequence[int]]] | None = None,
    ):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = int(max_shard_bytes)
        if self.max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.metadata = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
        self._plan = plan_shards(layout, self.max_shard_bytes) if layout is not None else None
        self._planned_names = [e[0] for shard in self._plan for e in shard] if self._plan is not None else []
        self._plan_entries = {e[0]: e for shard in self._plan or [] for e in shard}
        self._plan_shard_of = {e[0]: i for i, shard in enumerate(self._plan or []) for e in shard}
        if len(self._plan_entries) != len(self._planned_names):
            raise ValueError("the layout names a tensor twice")
        self._weight_map: dict[str, int] = {}  # name -> shard number (0-based)
        self._shards: list[list[tuple[str, str, tuple[int, ...], int]]] = []
        self._handle: Any = None  # the open shard: a binary file, or a wrapper that hashes it (surgery.write)
        self._shard_size = 0
        self._spool_paths: list[Path] = []
        self._closed = False
        self.files: list[Path] = []

    # -- shard lifecycle -------------------------------------------------------------------------------
    def _open_shard(self) -> None:
        number = len(self._shards)
        self._shards.append([])
        self._shard_size = 0
        if self._plan is not None:
            path = self.folder / shard_name(number + 1, len(self._plan))
            self._handle = open(path, "wb")
            self._handle.write(_header_bytes(self._plan[number], self.metadata))
        else:
            path = self.folder / f".shard-{number + 1:05d}.spool"
            self._spool_paths.append(path)
            self._handle = open(path, "wb")

    def _close_shard(self) -> None:
        if self._handle is None:
            return
        self._handle.close()
        self._handle = None

    def _start_tensor(self, name: str, dtype: str, shape: Sequence[int]) -> int:
        if self._closed:
            raise ValueError("the writer is closed")
        if name in self._weight_map:
            raise ValueError(f"tensor {name!r} was added twice")
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown safetensors dtype {dtype!r}")
        shape = tuple(int(d) for d in shape)
        nbytes = tensor_nbytes(dtype, shape)
        if self._plan is not None:
            position = len(self._weight_map)
            if position >= len(self._planned_names) or self._planned_names[position] != name:
                expected = self._planned_names[position] if position < len(self._planned_names) else None
                raise ValueError(f"tensor {name!r} added out of the planned order (expected {expected!r})")
            planned = self._plan_entries[name]
            if planned[1:] != (dtype, shape, nbytes):
                raise ValueError(f"tensor {name!r} is {dtype}{list(shape)}, planned {planned[1]}{list(planned[2])}")
            shard_no = self._plan_shard_of[name]
            while len(self._shards) <= shard_no:
                self._close_shard()
                self._open_shard()
        else:
            if self._handle is None or (self._shards[-1] and self._shard_size + nbytes > self.max_shard_bytes):
                self._close_shard()
                self._open_shard()
        self._shards[-1].append((name, dtype, shape, nbytes))
        self._weight_map[name] = len(self._shards) - 1
        self._shard_size += nbytes
        return nbytes

    # -- adding tensors ---------------------------------------------------------------------------------
    def add_tensor(self, name: str, tensor: torch.Tensor | np.ndarray) -> None:
        """Write one torch tensor or numpy array (its dtype and shape as given); the tensor is not kept."""
        self.add_raw(name, dtype_name(tensor.dtype), tuple(tensor.shape), tensor_to_bytes(tensor))

    def add_raw(self, name: str, dtype: str, shape: Sequence[int], data: _Bytes | Iterable[_Bytes]) -> None:
        """Write one tensor from raw bytes: a bytes-like object or an iterable of bytes-like chunks."""
        nbytes = self._start_tensor(name, dtype, shape)
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        written = 0
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            self._handle.write(view)
            written += len(view)
        if written != nbytes:
            raise ValueError(f"tensor {name!r}: got {written} bytes, expected {nbytes} for {dtype}{list(shape)}")

    def start_tensor(self, name: str, dtype: str, shape: Sequence[int]) -> int:
        """Begin a tensor whose bytes the caller then writes to `_file()` itself (surgery.write's hashed copy);
        returns its size."""
        return self._start_tensor(name, dtype, shape)

    def _file(self) -> BinaryIO:
        """The open shard file that raw copies go to (subclasses that wrap the handle return the real file)."""
        return self._handle

    def copy_from(self, reader: CheckpointReader, name: str, new_name: str | None = None) -> None:
        """Copy one tensor bit-identically from a checkpoint (kernel-side copy; no user-space buffer)."""
        info = reader.info(name)
        self._start_tensor(new_name or name, info.dtype, info.shape)
        copy_range(info.file, info.offset, info.nbytes, self._file())

    # -- finishing --------------------------------------------------------------------------------------
    def close(self) -> dict:
        """Finish the last shard, write `model.safetensors.index.json`, set modes 0644; returns the index."""
        if self._closed:
            raise ValueError("the writer is already closed")
        if self._plan is not None and len(self._weight_map) != len(self._planned_names):
            missing = [n for n in self._planned_names if n not in self._weight_map]
            raise ValueError(f"{len(missing)} planned tensor(s) never added (first: {missing[0]!r})")
        self._close_shard()
        self._closed = True
        count = len(self._shards)
        names = [shard_name(i + 1, count) for i in range(count)]
        if self._plan is None:
            for number, spool in enumerate(self._spool_paths):
                final = self.folder / names[number]
                with open(final, "wb") as out:
                    out.write(_header_bytes(self._shards[number], self.metadata))
                    copy_range(spool, 0, spool.stat().st_size, out)
                spool.unlink()
        total = sum(e[3] for shard in self._shards for e in shard)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: names[self._weight_map[name]] for name in sorted(self._weight_map)},
        }
        index_path = self.folder / INDEX_NAME
        index_path.write_text(json.dumps(index, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        self.files = [self.folder / n for n in names] + [index_path]
        for path in self.files:
            os.chmod(path, 0o644)
        return index

    def abort(self) -> None:
        """Close open handles and remove spool files after a failure (the caller removes the folder)."""
        self._close_shard()
        self._closed = True
        for spool in self._spool_paths:
            with contextlib.suppress(OSError):
                spool.unlink()

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def copy_file(src: Path, dst: Path) -> None:
    """Copy a file byte-for-byte (kernel copy where possible) and give it mode 0644."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, 0o644)


def save_tensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write a small single-file safetensors (e.g. a patch) deterministically, mode 0644.

    Values are torch tensors or numpy arrays (the same bytes either way); they are written in the order
    given; metadata values must be strings (JSON-encode structures).
    """
    path = Path(path)
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    entries = [(name, dtype_name(t.dtype), tuple(t.shape), tensor_nbytes(dtype_name(t.dtype), tuple(t.shape)))
               for name, t in tensors.items()]
    with open(path, "wb") as handle:
        handle.write(_header_bytes(entries, meta))
        for tensor in tensors.values():
            handle.write(tensor_to_bytes(tensor))
    os.chmod(path, 0o644)


def load_tensors(path: Path) -> tuple[dict, dict[str, str]]:
    """Read every tensor of a single safetensors file (torch tensors) plus its `__metadata__` (small files)."""
    reader = CheckpointReader(Path(path))
    return {name: reader.tensor(name) for name in reader.names()}, reader.shard_metadata(Path(path).name)


def load_arrays(path: Path) -> tuple[dict, dict[str, str]]:
    """Like `load_tensors`, as numpy arrays (torch-free)."""
    reader = CheckpointReader(Path(path))
    return {name: reader.array(name) for name in reader.names()}, reader.shard_metadata(Path(path).name)
