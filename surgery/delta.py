"""The patch without torch: low-rank factors as numpy arrays, the patch file, and W + U Vᵀ on row blocks.

`blaze apply` must not import torch (the CUDA build alone costs ≈ 700 MiB of memory, most of the 1 GiB
budget), so everything it needs lives here, on numpy and `ml_dtypes`:

- `PatchArrays`: per-matrix factors NAME -> (U: d_out×k, V: d_in×k), float32, ΔW = U Vᵀ, with the base
  identity and metadata; reads and writes `blaze_delta.safetensors`; rank and norm facts; fit checks.
  `surgery.patch.Patch` (torch tensors, used by edits and canaries) is a thin view over it, so the file
  format, the facts and the checks have one implementation.
- `RowBlockUpdate`: the one implementation of "add U Vᵀ to a block of rows of a stored tensor". Both
  `blaze edit` and `blaze apply` write variants through `surgery.write.write_variant`, which uses it, so
  the two give byte-identical shards by construction.
- `base_identity` / `identity_mismatches`: which base a patch belongs to (index hash + edited tensors' hashes).

Why a fixed elementwise order instead of a BLAS matrix product: a BLAS `sgemm` is free to sum the k
products in any order and to fuse multiply-adds, and does so differently per CPU kernel (measured: numpy's
and torch's float32 products differ in thousands of entries at k = 8). Here ΔW is built term by term,
((u₀v₀ᵀ + u₁v₁ᵀ) + …), every product and sum a correctly rounded IEEE float32 operation, then added to W
and cast back to the stored dtype with round-to-nearest-even. The bytes a patch produces therefore depend
only on the base and the patch, not on the machine or its BLAS — a published patch re-applied anywhere
reproduces the published shards. (For k = 1 this equals torch's `addmm`, which the earlier writer used.)
The cost is k elementwise passes per block, negligible next to the I/O for the small ranks edits use.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:  # a type name only: the release module is not needed at run time
    from clef_model.release import Release

import numpy as np

from clef_model.checkpoint import (
    INDEX_NAME,
    CheckpointReader,
    load_arrays,
    numpy_dtype,
    read_header,
    save_tensors,
)
from clef_model.errors import BlazeError
from clef_model.files import PATCH_FILE


class BaseMismatchError(BlazeError):
    """The base being patched is not the one the patch records (a tensor's stored bytes differ)."""
PATCH_FORMAT = "blaze-delta/1"
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


class PatchLike(Protocol):
    """A patch as the identity checks see it: `PatchArrays` or a torch `surgery.patch.Patch` (which imports this
    module, so it is described here rather than imported)."""

    base_identity: dict[str, Any] | None


class TorchPatch(PatchLike, Protocol):
    """A torch `surgery.patch.Patch`: it can view itself as `PatchArrays`."""

    def arrays(self) -> PatchArrays: ...


def check_factor_shapes(name: str, u_shape: Sequence[int], v_shape: Sequence[int]) -> None:
    """Refuse factors that are not U (d_out×k) and V (d_in×k) with the same k (numpy or torch shapes)."""
    if len(u_shape) != 2 or len(v_shape) != 2 or u_shape[1] != v_shape[1]:
        raise BlazeError(
            f"patch factors for {name!r} have shapes U{list(u_shape)}, V{list(v_shape)}; "
            "expected U (d_out×k) and V (d_in×k) with the same k."
        )


@dataclass
class PatchArrays:
    """Per-matrix factors NAME -> (U: d_out×k, V: d_in×k) as float32 numpy arrays, with ΔW = U Vᵀ.

    NAME is the on-disk tensor name without `.weight`. `base_identity` (or None) says which base the
    deltas belong to; `metadata` holds JSON-serialisable facts about how the patch was made.
    """

    factors: dict[str, tuple[np.ndarray, np.ndarray]]
    base_identity: dict | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, (u, v) in self.factors.items():
            u = np.ascontiguousarray(u, dtype=np.float32)
            v = np.ascontiguousarray(v, dtype=np.float32)
            check_factor_shapes(name, u.shape, v.shape)
            clean[name] = (u, v)
        self.factors = clean

    # -- facts --------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Edited matrix names (without `.weight`), sorted."""
        return sorted(self.factors)

    def rank(self, name: str) -> int:
        """k of one matrix's factors (an upper bound on the rank of its delta)."""
        return int(self.factors[name][0].shape[1])

    def delta_norm(self, name: str) -> float:
        """‖U Vᵀ‖_F from the k×k Gram matrices in float64 (never forms ΔW)."""
        u, v = (f.astype(np.float64) for f in self.factors[name])
        return float(np.sqrt(max(float(np.sum((u.T @ u) * (v.T @ v))), 0.0)))

    def delta_singular_values(self, name: str) -> np.ndarray:
        """Singular values of U Vᵀ (length min(k, d)), float64, from thin QR factors — cheap for big matrices."""
        u, v = (f.astype(np.float64) for f in self.factors[name])
        # numpy's stubs type mode="r" as the (Q, R) result; it returns R alone
        ru = cast(np.ndarray, np.linalg.qr(u, mode="r"))
        rv = cast(np.ndarray, np.linalg.qr(v, mode="r"))
        return np.linalg.svd(ru @ rv.T, compute_uv=False)

    def numerical_rank(self, name: str) -> int:
        """Numerical rank of U Vᵀ (singular values above max(d) · ε_fp32 · σ_max)."""
        values = self.delta_singular_values(name)
        if values.size == 0 or float(values[0]) == 0.0:
            return 0
        u, v = self.factors[name]
        tol = float(values[0]) * max(u.shape[0], v.shape[0]) * float(np.finfo(np.float32).eps)
        return int(np.sum(values > tol))

    # -- files --------------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write `NAME.U` / `NAME.V` float32 tensors, with base identity and metadata as JSON in the header."""
        tensors: dict[str, np.ndarray] = {}
        for name in self.names():
            u, v = self.factors[name]
            tensors[f"{name}.U"] = u
            tensors[f"{name}.V"] = v
        meta = {
            "blaze_format": PATCH_FORMAT,
            "blaze_base_identity": json.dumps(self.base_identity, sort_keys=True),
            "blaze_metadata": json.dumps(self.metadata, sort_keys=True, default=str),
        }
        save_tensors(Path(path), tensors, meta)

    @classmethod
    def load(cls, path: Path) -> PatchArrays:
        """Read a patch file (or a variant folder holding `blaze_delta.safetensors`); BlazeError if it is not one."""
        path = patch_path(path)
        arrays, meta = load_arrays(path)
        if meta.get("blaze_format") != PATCH_FORMAT:
            raise BlazeError(f"{path}: not a blaze patch (format {meta.get('blaze_format')!r}, expected {PATCH_FORMAT!r}).")
        factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key in arrays:
            base, _, part = key.rpartition(".")
            if part not in ("U", "V") or not base:
                raise BlazeError(f"{path}: unexpected tensor {key!r}; a patch holds only NAME.U and NAME.V.")
            if base.endswith(".weight"):  # NAME.weight.U would be reported as NAME.weight.weight
                raise BlazeError(f"{path}: tensor {key!r} names a matrix with its `.weight` suffix; a patch holds "
                                 f"NAME.U and NAME.V for the base tensor NAME.weight (here {base[:-7]}.U).")
            if f"{base}.U" not in arrays or f"{base}.V" not in arrays:
                raise BlazeError(f"{path}: {base!r} has only one of its two factors (U, V); the file is damaged.")
            factors[base] = (arrays[f"{base}.U"].astype(np.float32, copy=False),
                             arrays[f"{base}.V"].astype(np.float32, copy=False))
        identity, metadata = _patch_metadata(path, meta)
        return cls(factors, identity, metadata)

    # -- fitting a base -----------------------------------------------------------------------------------
    def problems_with(self, reader: CheckpointReader) -> list[str]:
        """Why this patch cannot be applied to a checkpoint (empty list: it fits)."""
        problems = []
        for name in self.names():
            weight = f"{name}.weight"
            u, v = self.factors[name]
            if weight not in reader:
                problems.append(f"{weight} is not in the base checkpoint")
                continue
            shape = reader.shape(weight)
            if len(shape) != 2 or shape != (u.shape[0], v.shape[0]):
                problems.append(f"{weight} is {list(shape)} but the patch's U·Vᵀ is {[u.shape[0], v.shape[0]]}")
            elif reader.dtype(weight) not in FLOAT_DTYPES:
                problems.append(f"{weight} is stored as {reader.dtype(weight)}, not a float type")
            elif not (np.isfinite(u).all() and np.isfinite(v).all()):
                problems.append(f"the factors of {name} hold NaN or infinity")
        return problems

    def check_fits(self, reader: CheckpointReader) -> None:
        """Raise BlazeError listing every reason the patch does not fit the checkpoint."""
        problems = self.problems_with(reader)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise BlazeError(f"the patch does not fit the base at {reader.folder}: {shown}. "
                             "Use the base the patch was made from.")


_IDENTITY_TYPES = {"ref": str, "revision": str, "index_sha256": str, "tensor_sha256": dict}


def _patch_metadata(path: Path, meta: dict[str, Any]) -> tuple[dict | None, dict]:
    """The patch's base identity and edit metadata, checked for shape: JSON text holding an object (the
    identity may be null), the identity's fields of their types, and, once an identity is recorded, a
    ``tensor_sha256`` object of name → digest (:func:`surgery.apply.patch_problems` refuses an identity that does
    not list every edited tensor)."""
    def damaged(why: str) -> BlazeError:
        return BlazeError(f"{path}: the patch metadata {why}; the file is damaged or was not written by blaze.")

    parsed = []
    for key, empty in (("blaze_base_identity", "null"), ("blaze_metadata", "{}")):
        text = meta.get(key, empty)
        if not isinstance(text, str):
            raise damaged(f"field {key} is not a string")
        try:
            parsed.append(json.loads(text))
        except (ValueError, RecursionError) as error:
            raise damaged(f"field {key} is not valid JSON ({type(error).__name__})") from None
    identity, metadata = parsed
    if not isinstance(metadata, dict):
        raise damaged("field blaze_metadata is not a JSON object")
    if identity is None:
        return None, metadata
    if not isinstance(identity, dict):
        raise damaged("field blaze_base_identity is not a JSON object")
    for field_name, kind in _IDENTITY_TYPES.items():
        if identity.get(field_name) is not None and not isinstance(identity[field_name], kind):
            raise damaged(f"base identity field {field_name} is not a {kind.__name__}")
    digests = identity.get("tensor_sha256") or {}
    if any(not isinstance(k, str) or not isinstance(v, str) for k, v in digests.items()):
        raise damaged("base identity tensor_sha256 holds entries that are not name → digest strings")
    return identity, metadata


def patch_path(path: Path) -> Path:
    """The patch file named by `path` (a file, or a variant folder holding one); BlazeError when absent."""
    path = Path(path)
    if path.is_dir():
        path = path / PATCH_FILE
    if not path.is_file():
        raise BlazeError(f"{path}: no such patch file; pass a blaze_delta.safetensors or a variant folder.")
    return path


def as_arrays(patch: PatchArrays | TorchPatch) -> PatchArrays:
    """A `PatchArrays` for a `PatchArrays` or a `surgery.patch.Patch` (whose `arrays()` shares memory)."""
    return patch if isinstance(patch, PatchArrays) else patch.arrays()


class RowBlockUpdate:
    """W + U Vᵀ for one stored tensor, a block of rows at a time; the only place a patch changes weights on disk.

    Math in float32 (float64 for F64 tensors): ΔW's block is built term by term in a fixed order (see the
    module docstring), added to W, and cast back to the stored dtype with round-to-nearest-even
    (`ml_dtypes` for bfloat16 / float8, numpy for IEEE types). Keeps running sums of ‖W‖² and
    ‖W_new − W‖² (the realised change, after rounding) for the manifest. Workspaces are reused between
    blocks, so memory stays at a few blocks whatever the tensor size.
    """

    def __init__(self, u: np.ndarray, v: np.ndarray, dtype: str):
        if dtype not in FLOAT_DTYPES:
            raise BlazeError(f"cannot edit a tensor stored as {dtype}; only {sorted(FLOAT_DTYPES)} are supported.")
        self.stored = numpy_dtype(dtype)
        self.work = np.dtype(np.float64 if dtype == "F64" else np.float32)
        self.u = np.ascontiguousarray(u, dtype=self.work)
        self.v_rows = [np.ascontiguousarray(v[:, j], dtype=self.work)[None, :] for j in range(v.shape[1])]
        self.cols = v.shape[0]
        self.weight_sq = 0.0
        self.change_sq = 0.0
        self._buffers: dict[str, np.ndarray] = {}

    def _buffer(self, key: str, rows: int, dtype: np.dtype) -> np.ndarray:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < rows or buffer.dtype != dtype:
            buffer = self._buffers[key] = np.empty((rows, self.cols), dtype=dtype)
        return buffer[:rows]

    def apply(self, block: np.ndarray, start: int) -> tuple[np.ndarray, float, float]:
        """Return (new rows in the stored dtype, ‖W_block‖², ‖ΔW_block realised‖²) for rows start… of W.

        `block` holds rows × cols values in the stored dtype (it is only read). The returned array is newly
        allocated (the caller may hand it to another thread); the float32 workspaces are reused.
        """
        rows = block.shape[0]
        u = self.u[start : start + rows]
        weight = self._buffer("weight", rows, self.work)
        delta = self._buffer("delta", rows, self.work)
        with np.errstate(over="ignore", invalid="ignore"):
            weight[...] = block
            np.multiply(u[:, 0:1], self.v_rows[0], out=delta)
            if len(self.v_rows) > 1:
                term = self._buffer("term", rows, self.work)
                for j in range(1, len(self.v_rows)):
                    np.multiply(u[:, j : j + 1], self.v_rows[j], out=term)
                    np.add(delta, term, out=delta)
            np.add(weight, delta, out=delta)  # delta now holds W + ΔW in the working dtype
            new = delta.astype(self.stored)  # round to nearest even (a plain copy when stored == work)
            if self.stored != self.work:
                delta[...] = new  # the rounded values: measure the change actually written
            np.subtract(delta, weight, out=delta)
            flat_w, flat_d = weight.reshape(-1), delta.reshape(-1)
            weight_sq = float(np.dot(flat_w, flat_w))
            change_sq = float(np.dot(flat_d, flat_d))
        self.weight_sq += weight_sq
        self.change_sq += change_sq
        return new, weight_sq, change_sq


def tensor_sha256(reader: CheckpointReader, name: str) -> str:
    """SHA-256 of one tensor's raw stored bytes."""
    digest = hashlib.sha256()
    for chunk in reader.iter_raw(name):
        digest.update(chunk)
    return digest.hexdigest()


def base_identity(release: Release, names: list[str]) -> dict:
    """Identity of a base for a patch editing `names`: ref, revision, index hash, and each edited tensor's hash.

    `release` is a `clef_model.release.Release` (or anything with `path`, `ref`, `revision`). Hashing only
    the edited tensors keeps this cheap on a 19 GB checkpoint while still catching a different base.
    `shard_sha256` records the SHA-256 of the shards holding those tensors where a Hugging Face cache blob
    name gives it (nothing is read for it): a later `blaze apply` to a base whose shard has the same known
    hash can skip hashing the tensors inside it (`trusted_tensor_sha256`). blaze's own hash cache is not
    consulted here, so the patch (and the manifest that copies it) is the same bytes whatever state the
    cache is in: a first edit and a rerun give byte-identical files.
    """
    from clef_model.filehash import file_sha256, hub_blob_sha256

    reader = CheckpointReader(Path(release.path))
    index = reader.index_path
    if index is not None:
        index_hash = file_sha256(index)
    else:
        shard = reader.shard_files()[0]
        header, _ = read_header(shard)
        index_hash = hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()
    return {
        "ref": str(getattr(release, "ref", release.path)),
        "revision": getattr(release, "revision", None),
        "index_sha256": index_hash,
        "index_file": INDEX_NAME if index is not None else reader.shard_files()[0].name,
        "total_size": reader.total_bytes(),
        "tensor_sha256": {name: tensor_sha256(reader, f"{name}.weight") for name in sorted(names)},
        "shard_sha256": {shard.name: digest for shard in sorted({reader.info(f"{n}.weight").file for n in names})
                         if (digest := hub_blob_sha256(shard)) is not None},
    }


def trusted_tensor_sha256(patch: PatchLike, release: Release) -> dict[str, str]:
    """Recorded tensor hashes (NAME -> SHA-256) that hold for `release` without reading the tensors.

    A tensor qualifies when its shard in `release` has the same file name and an already-known SHA-256
    (Hub blob name, hash cache) equal to the one recorded in the patch: the same file holds the same bytes.
    Only meaningful after the index check passed (same index, so the same tensor-to-shard map).
    """
    from clef_model.filehash import known_sha256

    recorded = patch.base_identity or {}
    shards = recorded.get("shard_sha256") or {}
    if not shards:
        return {}
    reader = CheckpointReader(Path(release.path))
    trusted = {}
    for name, digest in recorded.get("tensor_sha256", {}).items():
        if f"{name}.weight" not in reader:
            continue
        shard = reader.info(f"{name}.weight").file
        if shards.get(shard.name) is not None and known_sha256(shard) == shards[shard.name]:
            trusted[name] = digest
    return trusted


def identity_mismatches(patch: PatchLike, release: Release) -> list[str]:
    """How `release` differs from the base recorded in `patch` (empty: same base, or nothing recorded)."""
    return check_identity(patch, release)[0]


def check_identity(patch: PatchLike, release: Release, *, tensors: bool = True) -> tuple[list[str], dict[str, str]]:
    """(`identity_mismatches`, the SHA-256 of the recorded tensors as found in `release`: NAME -> digest).

    The digests let a caller that goes on to stream the same tensors skip hashing them a second time.
    With `tensors=False` only the index (and that every recorded tensor exists) is checked, which reads
    nothing but the index; `blaze apply` then verifies the tensors' hashes while it streams them
    (`surgery.write.write_variant(expect_tensor_sha256=...)`) instead of reading them twice.
    """
    recorded = patch.base_identity
    if not recorded:
        return [], {}
    reader = CheckpointReader(Path(release.path))
    present = [n for n in recorded.get("tensor_sha256", {}) if f"{n}.weight" in reader]
    current = base_identity(release, present if tensors else [])
    problems = []
    if recorded.get("index_sha256") and recorded["index_sha256"] != current["index_sha256"]:
        problems.append(f"its checkpoint index differs (hash {current['index_sha256'][:12]}…, "
                        f"patch made on {recorded['index_sha256'][:12]}…)")
    for name, digest in recorded.get("tensor_sha256", {}).items():
        if name not in present:
            problems.append(f"{name}.weight is missing")
        elif tensors and current["tensor_sha256"][name] != digest:
            problems.append(f"{name}.weight has different values")
    return problems, current["tensor_sha256"]
