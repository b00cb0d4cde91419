"""Integrity: a variant is its base plus low-rank deltas, nothing else.

Checks that the joint head (`joint_head.safetensors`) and the release code have the same SHA-256 in both
releases, that every other side file of the base is byte-identical in the variant (files only the variant has,
such as its canary report, are listed as added and allowed), that both checkpoints hold the same tensor names,
shapes and dtypes (else: a variant of another base, refused with BlazeError), and lists the tensors whose raw
bytes differ, each with its relative change ‖ΔW‖/‖W‖ and the numerical rank of ΔW.

Numerical rank: singular values of ΔW (fp32) above τ = max(σ₁·max(m,n)·ε₃₂, 2·u·rms(W)·(√m+√n)), where u is
the unit roundoff of the stored dtype (2⁻⁸ bf16, 2⁻¹¹ fp16, 2⁻²⁴ fp32). The second term is about 3.5× the
spectral norm of the rounding noise a cast back to the stored dtype adds, which is full rank and must not count.

Cost: tensors are compared by raw bytes one at a time (no decoding); only differing ones are decoded; side files
are hashed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clef_model.errors import BlazeError
from clef_model.files import (
    CARD_FILE,
    GITATTRIBUTES,
    INDEX_FILE,
    JOINT_HEAD,
    MANIFEST_FILE,
    PATCH_FILE,
    RELEASE_CODE,
)
from clef_model.manifest import BaseInfo, Manifest, find_manifest

if TYPE_CHECKING:
    from clef_model.checkpoint import CheckpointReader
    from clef_model.release import Release

# Side files a variant may legitimately differ in: its own manifest/delta/card and the shard index
# (a re-sharded checkpoint has another index; tensors are compared one by one instead).
VARIANT_OWN_FILES = {MANIFEST_FILE, PATCH_FILE, CARD_FILE, INDEX_FILE, GITATTRIBUTES}
UNIT_ROUNDOFF = {"BF16": 2.0**-8, "F16": 2.0**-11, "F32": 2.0**-24, "F64": 2.0**-53}


def _release(ref: Any) -> Release:
    from clef_model.release import Release, resolve_release

    return ref if isinstance(ref, Release) else resolve_release(ref)


def numerical_rank(delta: torch.Tensor, weight_rms: float, dtype: str, device: str | torch.device = "cpu") -> int:
    """Numerical rank of a 2-D delta, ignoring the rounding noise of the stored dtype (see module doc)."""
    matrix = delta.to(device=device, dtype=torch.float32)
    rows, cols = matrix.shape
    singular = torch.linalg.svdvals(matrix)
    if singular.numel() == 0 or float(singular[0]) == 0.0:
        return 0
    roundoff = UNIT_ROUNDOFF.get(dtype.upper(), 2.0**-8)
    tolerance = max(float(singular[0]) * max(rows, cols) * torch.finfo(torch.float32).eps,
                    2.0 * roundoff * weight_rms * (math.sqrt(rows) + math.sqrt(cols)))
    return int((singular > tolerance).sum())


REPORT_MANIFEST_KEY = "variant_manifest_sha256"  # in a canary report's `meta`: the weights it was run on


def manifest_sha256(folder: Path) -> str | None:
    """SHA-256 of a variant folder's manifest file (None for a folder without one, e.g. a base).

    The manifest lists every file's SHA-256, so this one hash names the variant's weights: a canary
    report records it (`meta.variant_manifest_sha256`) and `blaze publish` checks it.
    """
    from clef_model.checkpoint import sha256_file

    path = Path(folder) / MANIFEST_FILE
    return sha256_file(path) if path.is_file() else None


def report_manifest_sha256(report: dict[str, Any]) -> str | None:
    """The manifest SHA-256 a canary report records for the variant it ran on (None when it records none)."""
    meta = report.get("meta")
    value = meta.get(REPORT_MANIFEST_KEY) if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") and name.startswith("model") or name == INDEX_FILE


def side_file_integrity(manifest: Manifest) -> tuple[bool, list[str]]:
    """File-level integrity from the manifest alone: every side file equals the base's.

    The manifest records the SHA-256 of each base input file (``base.files``) and of each output file
    (``output.files``). Weight shards and their index legitimately differ; everything else (joint head,
    release code, tokenizer, configs, LICENSE) must be byte-identical, and a Clef release's joint head and
    release code must be present. `blaze publish` and the model card use this when the canary report carries
    no integrity verdict (``blaze edit`` runs its canary before the folder exists); it does not compare
    tensors with the base.
    """
    base_files, out_files = manifest.base.files, manifest.output.files
    if not base_files:
        return False, ["the manifest records no base file hashes: no integrity check is possible"]
    problems = []
    for name, digest in sorted(base_files.items()):
        if name == CARD_FILE or _is_weight_file(name):
            continue
        if name not in out_files:
            problems.append(f"{name}: in the base but not in the variant")
        elif out_files[name].lower() != digest.lower():
            problems.append(f"{name}: differs from the base's (SHA-256)")
    if JOINT_HEAD in base_files:
        for name in (JOINT_HEAD, RELEASE_CODE):
            if name not in base_files or name not in out_files:
                problems.append(f"{name}: missing, so the typed-decision path cannot be trusted")
    return not problems, problems


def _manifest_base_mismatch(manifest: Manifest | None, base) -> str | None:
    """A reason the manifest names another base than `base`, or None when it agrees or says nothing.

    Uses what `surgery.patch.base_identity` records: the checkpoint index hash (when the base has an index)
    and the SHA-256 of each edited tensor's stored bytes in the base.
    """
    identity = manifest.base if manifest is not None else BaseInfo()
    from clef_model.checkpoint import CheckpointReader, sha256_file

    index_hash = identity.index_sha256
    index_path = Path(base.path) / INDEX_FILE
    if index_hash and (identity.index_file or INDEX_FILE) == index_path.name \
            and index_path.is_file() and sha256_file(index_path) != index_hash:
        return (f"the variant's manifest records base index sha256 {index_hash[:12]}…, but {base.ref} has "
                f"{sha256_file(index_path)[:12]}…")
    if not identity.tensor_sha256:
        return None
    reader = CheckpointReader(Path(base.path))
    for name, digest in identity.tensor_sha256.items():
        full = name if name in reader else f"{name}.weight"
        if full not in reader:
            return f"the manifest's base has tensor {full}, which {base.ref} lacks"
        h = hashlib.sha256()
        for chunk in reader.iter_raw(full):
            h.update(chunk)
        if h.hexdigest() != digest:
            return f"{full} in {base.ref} is not the tensor the variant was made from (SHA-256 differs)"
    return None


def _check_same_layout(variant: Release, base: Release, v_reader: CheckpointReader,
                       b_reader: CheckpointReader) -> set[str]:
    """The base's tensor names; BlazeError when the variant's names, shapes or dtypes differ from the base's."""
    v_names, b_names = set(v_reader.names()), set(b_reader.names())
    if v_names != b_names:
        missing, extra = sorted(b_names - v_names), sorted(v_names - b_names)
        raise BlazeError(
            f"{variant.ref} is not a variant of {base.ref}: tensor names differ "
            f"({len(missing)} missing, e.g. {missing[:2]}; {len(extra)} extra, e.g. {extra[:2]}); "
            "pass the base it was made from with --against")
    for name in sorted(b_names):
        if tuple(v_reader.shape(name)) != tuple(b_reader.shape(name)) or v_reader.dtype(name) != b_reader.dtype(name):
            raise BlazeError(
                f"{variant.ref} is not a variant of {base.ref}: tensor {name} is {v_reader.dtype(name)} "
                f"{tuple(v_reader.shape(name))} there but {b_reader.dtype(name)} {tuple(b_reader.shape(name))} in "
                "the base; pass the base it was made from with --against")
    return b_names


def _changed_tensors(names: list[str], v_reader: CheckpointReader, b_reader: CheckpointReader,
                     device: str | torch.device, progress: bool) -> tuple[list[dict[str, Any]], int]:
    """(one entry per tensor whose bytes differ: relative change and numerical rank, the number identical)."""
    iterator: Iterable[str] = names
    if progress:
        from tqdm import tqdm

        iterator = tqdm(names, desc="integrity", unit="tensor", leave=False)
    changed = []
    identical = 0
    for name in iterator:
        if bytes(v_reader.raw_bytes(name)) == bytes(b_reader.raw_bytes(name)):
            identical += 1
            continue
        weight = b_reader.tensor(name).to(torch.float32)
        delta = v_reader.tensor(name).to(torch.float32) - weight
        entry: dict[str, Any] = {
            "name": name, "shape": list(weight.shape), "dtype": b_reader.dtype(name),
            "relative_change": float(delta.norm() / weight.norm()) if float(weight.norm()) > 0 else float("inf"),
        }
        if delta.dim() == 2:
            rms = float(weight.pow(2).mean().sqrt())
            entry["rank"] = numerical_rank(delta, rms, b_reader.dtype(name), device)
        else:
            entry["rank"] = None
        changed.append(entry)
    return changed, identical


def check_integrity(variant: Any, base: Any, *, device: str | torch.device = "cpu", progress: bool = False) -> dict:
    """Compare a variant release with its base (see module doc). Raises BlazeError for a variant of another base."""
    from clef_model.checkpoint import CheckpointReader, sha256_file

    variant, base = _release(variant), _release(base)
    manifest = find_manifest(Path(variant.path))
    mismatch = _manifest_base_mismatch(manifest, base)
    if mismatch:
        raise BlazeError(f"{variant.ref} is a variant of another base: {mismatch}; pass its own base with --against")
    v_reader, b_reader = CheckpointReader(Path(variant.path)), CheckpointReader(Path(base.path))
    b_names = _check_same_layout(variant, base, v_reader, b_reader)

    files: dict[str, dict[str, Any]] = {}
    base_side = set(base.side_files())
    added = sorted(name for name in set(variant.side_files()) - base_side if name not in VARIANT_OWN_FILES)
    for name in sorted(base_side):
        if name in VARIANT_OWN_FILES:
            continue
        b_path, v_path = Path(base.path) / name, Path(variant.path) / name
        b_hash = sha256_file(b_path)
        v_hash = sha256_file(v_path) if v_path.is_file() else None
        files[name] = {"base": b_hash, "variant": v_hash, "equal": b_hash == v_hash}
    joint_head = files.get(JOINT_HEAD)
    release_code = files.get(RELEASE_CODE)

    changed, identical = _changed_tensors(sorted(b_names), v_reader, b_reader, device, progress)

    problems = []
    if base.kind == "clef" or variant.kind == "clef":
        for label, hashes, file in (("joint head", joint_head, JOINT_HEAD), ("release code", release_code, RELEASE_CODE)):
            if hashes is None or not hashes["equal"]:
                problems.append(f"{label} ({file}) differs from the base")
    for name, entry in files.items():
        if name not in (JOINT_HEAD, RELEASE_CODE) and not entry["equal"]:
            problems.append(f"side file {name} {'is missing' if entry['variant'] is None else 'differs from the base'}")
    listed = _manifest_tensors(manifest)
    if listed is not None:
        unexpected = [c["name"] for c in changed if c["name"] not in listed]
        if unexpected:
            problems.append(f"{len(unexpected)} changed tensor(s) not listed in the manifest, e.g. {unexpected[0]}")
    return {
        "passed": not problems,
        "problems": problems,
        "joint_head_sha256": joint_head,
        "release_code_sha256": release_code,
        "side_files": files,
        "added_files": added,  # files only the variant has (its canary report, model card, …): allowed
        "tensors": len(b_names),
        "identical_tensors": identical,
        "changed_tensors": changed,
    }


def _manifest_tensors(manifest: Manifest | None) -> set[str] | None:
    """Names of the tensors the manifest says were edited (None when it does not say)."""
    if manifest is None:
        return None
    names = manifest.edited_tensors if manifest.edited_tensors is not None else tuple(manifest.matrices) or None
    if names is None:
        return None
    return {v if v.endswith(".weight") else f"{v}.weight" for v in names}
