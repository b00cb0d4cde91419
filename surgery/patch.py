"""The patch: low-rank weight deltas ΔW = U Vᵀ per matrix, saved as `blaze_delta.safetensors`.

A patch is what an edit produces and what `blaze apply` re-applies. It records the identity of the base it
was computed on (checkpoint index hash and a hash of every targeted tensor), so applying it to another
base can be refused. `Patch.applied` toggles the edit on a loaded model in memory (used by the strength
sweep and the canaries) and restores the exact original weights afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from clef_model.checkpoint import INDEX_NAME, CheckpointReader, load_tensors, read_header, save_tensors, sha256_file
from clef_model.errors import BlazeError

PATCH_FILE = "blaze_delta.safetensors"
PATCH_FORMAT = "blaze-delta/1"
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


@dataclass
class Patch:
    """Per-matrix factors NAME -> (U: d_out×k, V: d_in×k) in float32, with ΔW = U Vᵀ.

    NAME is the on-disk tensor name without `.weight` (as `Runtime.named_linears()` keys it); the stored
    tensor is `NAME.weight`. `base_identity` (or None) says which base the deltas belong to; `metadata`
    holds JSON-serialisable facts about how the patch was made (method, strength, rank, …).
    """

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_identity: dict | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, (u, v) in self.factors.items():
            if u.dim() != 2 or v.dim() != 2 or u.shape[1] != v.shape[1]:
                raise BlazeError(
                    f"patch factors for {name!r} have shapes U{list(u.shape)}, V{list(v.shape)}; "
                    "expected U (d_out×k) and V (d_in×k) with the same k."
                )
            clean[name] = (u.detach().to("cpu", torch.float32).contiguous(), v.detach().to("cpu", torch.float32).contiguous())
        self.factors = clean

    # -- facts --------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Edited matrix names (without `.weight`), sorted."""
        return sorted(self.factors)

    def rank(self, name: str) -> int:
        """k of one matrix's factors (an upper bound on the rank of its delta)."""
        return int(self.factors[name][0].shape[1])

    def delta(self, name: str) -> torch.Tensor:
        """ΔW = U Vᵀ of one matrix, float32 (d_out × d_in)."""
        u, v = self.factors[name]
        return u @ v.T

    def delta_norm(self, name: str) -> float:
        """‖U Vᵀ‖_F computed from the k×k Gram matrices (never forms ΔW)."""
        u, v = (t.double() for t in self.factors[name])
        return float(torch.sum((u.T @ u) * (v.T @ v)).clamp_min(0).sqrt())

    def delta_singular_values(self, name: str) -> torch.Tensor:
        """Singular values of U Vᵀ (length k), from thin QR factors — cheap even for big matrices."""
        u, v = (t.double() for t in self.factors[name])
        _, ru = torch.linalg.qr(u)
        _, rv = torch.linalg.qr(v)
        return torch.linalg.svdvals(ru @ rv.T)

    def numerical_rank(self, name: str) -> int:
        """Numerical rank of U Vᵀ (singular values above max(d) · ε_fp32 · σ_max)."""
        values = self.delta_singular_values(name)
        if values.numel() == 0 or float(values[0]) == 0.0:
            return 0
        u, v = self.factors[name]
        tol = float(values[0]) * max(u.shape[0], v.shape[0]) * torch.finfo(torch.float32).eps
        return int((values > tol).sum())

    # -- transforms -----------------------------------------------------------------------------------------
    def scaled(self, s: float) -> "Patch":
        """The same edit at `s` times the strength (U scaled by s); metadata["scale"] is multiplied by s."""
        metadata = dict(self.metadata)
        metadata["scale"] = float(metadata.get("scale", 1.0)) * float(s)
        return Patch({n: (u * float(s), v.clone()) for n, (u, v) in self.factors.items()},
                     dict(self.base_identity) if self.base_identity else None, metadata)

    # -- files --------------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write `NAME.U` / `NAME.V` float32 tensors, with base identity and metadata as JSON in the header."""
        tensors: dict[str, torch.Tensor] = {}
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
    def load(cls, path: Path) -> "Patch":
        """Read a patch file (or a variant folder holding `blaze_delta.safetensors`); BlazeError if it is not one."""
        path = Path(path)
        if path.is_dir():
            path = path / PATCH_FILE
        if not path.is_file():
            raise BlazeError(f"{path}: no such patch file; pass a blaze_delta.safetensors or a variant folder.")
        tensors, meta = load_tensors(path)
        if meta.get("blaze_format") != PATCH_FORMAT:
            raise BlazeError(f"{path}: not a blaze patch (format {meta.get('blaze_format')!r}, expected {PATCH_FORMAT!r}).")
        factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key in tensors:
            base, _, part = key.rpartition(".")
            if part not in ("U", "V") or not base:
                raise BlazeError(f"{path}: unexpected tensor {key!r}; a patch holds only NAME.U and NAME.V.")
            if f"{base}.U" not in tensors or f"{base}.V" not in tensors:
                raise BlazeError(f"{path}: {base!r} has only one of its two factors (U, V); the file is damaged.")
            factors[base] = (tensors[f"{base}.U"].float(), tensors[f"{base}.V"].float())
        try:
            identity = json.loads(meta.get("blaze_base_identity", "null"))
            metadata = json.loads(meta.get("blaze_metadata", "{}"))
        except json.JSONDecodeError as error:
            raise BlazeError(f"{path}: the patch metadata is not valid JSON ({error}); the file is damaged.") from None
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
            elif reader.dtype(weight) not in _FLOAT_DTYPES:
                problems.append(f"{weight} is stored as {reader.dtype(weight)}, not a float type")
            elif not (torch.isfinite(u).all() and torch.isfinite(v).all()):
                problems.append(f"the factors of {name} hold NaN or infinity")
        return problems

    def check_fits(self, reader: CheckpointReader) -> None:
        """Raise BlazeError listing every reason the patch does not fit the checkpoint."""
        problems = self.problems_with(reader)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise BlazeError(f"the patch does not fit the base at {reader.folder}: {shown}. "
                             "Use the base the patch was made from.")

    # -- in memory ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def applied(self, runtime, scale: float = 1.0) -> Iterator[None]:
        """Add scale·U Vᵀ to the live weights of `runtime` (in fp32, cast back); restore the originals on exit."""
        linears: Mapping[str, torch.nn.Linear] = runtime.named_linears()
        missing = [n for n in self.names() if n not in linears]
        if missing:
            raise BlazeError(f"the loaded model has no linear layer {missing[0]!r} (and {len(missing) - 1} more "
                             "missing); the patch was made for another architecture.")
        originals: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for name in self.names():
                    weight = linears[name].weight
                    u, v = self.factors[name]
                    if tuple(weight.shape) != (u.shape[0], v.shape[0]):
                        raise BlazeError(f"{name}.weight is {list(weight.shape)} but the patch's U·Vᵀ is "
                                         f"{[u.shape[0], v.shape[0]]}; the patch was made for another base.")
                    originals[name] = weight.detach().clone()
                    u, v = u.to(weight.device), v.to(weight.device)
                    updated = weight.detach().float().addmm_(u, v.T, alpha=float(scale))
                    weight.copy_(updated.to(weight.dtype))
                    del updated
            yield
        finally:
            with torch.no_grad():
                for name, original in originals.items():
                    linears[name].weight.copy_(original)


def tensor_sha256(reader: CheckpointReader, name: str) -> str:
    """SHA-256 of one tensor's raw stored bytes."""
    digest = hashlib.sha256()
    for chunk in reader.iter_raw(name):
        digest.update(chunk)
    return digest.hexdigest()


def base_identity(release, names: list[str]) -> dict:
    """Identity of a base for a patch editing `names`: ref, revision, index hash, and each edited tensor's hash.

    `release` is a `clef_model.release.Release` (or anything with `path`, `ref`, `revision`). Hashing only
    the edited tensors keeps this cheap on a 19 GB checkpoint while still catching a different base.
    """
    reader = CheckpointReader(Path(release.path))
    index = reader.index_path
    if index is not None:
        index_hash = sha256_file(index)
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
    }


def identity_mismatches(patch: Patch, release) -> list[str]:
    """How `release` differs from the base recorded in the patch (empty: same base, or nothing recorded)."""
    recorded = patch.base_identity
    if not recorded:
        return []
    reader = CheckpointReader(Path(release.path))
    current = base_identity(release, [n for n in recorded.get("tensor_sha256", {}) if f"{n}.weight" in reader])
    problems = []
    if recorded.get("index_sha256") and recorded["index_sha256"] != current["index_sha256"]:
        problems.append(f"its checkpoint index differs (hash {current['index_sha256'][:12]}…, "
                        f"patch made on {recorded['index_sha256'][:12]}…)")
    for name, digest in recorded.get("tensor_sha256", {}).items():
        if name not in current["tensor_sha256"]:
            problems.append(f"{name}.weight is missing")
        elif current["tensor_sha256"][name] != digest:
            problems.append(f"{name}.weight has different values")
    return problems
