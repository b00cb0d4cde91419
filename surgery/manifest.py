"""Build, write and verify `blaze_manifest.json` (the `Manifest` type itself is `clef_model.manifest`).

The manifest is written last by `surgery.write.write_variant`. It holds no timestamps, so the same edit
of the same base gives the same manifest (and `blaze apply` re-creates it). `verify_manifest` re-hashes a
variant folder against it.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path
from typing import Any

from clef_model.checkpoint import sha256_file
from clef_model.files import MANIFEST_FILE
from clef_model.manifest import MANIFEST_VERSION, VERSION_KEY, Manifest, find_manifest, read_manifest

_PACKAGES = ("blaze", "numpy", "ml_dtypes", "torch", "transformers", "safetensors", "huggingface_hub", "peft",
             "clef-finetune")

__all__ = ["MANIFEST_FILE", "MANIFEST_VERSION", "Manifest", "build_manifest", "find_manifest", "package_versions",
           "read_manifest", "verify_manifest", "write_manifest"]


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that decide a variant's bytes (None when absent), plus Python."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_manifest(
    *,
    base: dict,
    patch_file: str,
    patch_metadata: dict,
    base_identity: dict | None,
    edit: dict | None,
    matrices: dict[str, dict],
    output_files: dict[str, str],
    output_total_size: int,
    edited_tensors: list[str] | None = None,
) -> Manifest:
    """The variant's `Manifest` from what the writer knows (see the module docstring).

    The values go through JSON once (non-JSON values become strings, as in the file), so the returned
    manifest is exactly what `to_json` writes and `Manifest.from_json` reads back.
    """
    raw: dict[str, Any] = {
        VERSION_KEY: MANIFEST_VERSION,
        "base": base,
        "patch": {"file": patch_file, "metadata": patch_metadata, "base_identity": base_identity},
        "edit": edit or {},
        "matrices": matrices,
        "versions": package_versions(),
        "output": {"total_size": output_total_size, "files": dict(sorted(output_files.items()))},
    }
    if edited_tensors is not None:
        raw["edited_tensors"] = list(edited_tensors)
    return Manifest.from_json(json.dumps(raw, default=str))


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write the manifest as sorted, indented JSON (stable bytes for the same content)."""
    Path(path).write_text(manifest.to_json(), encoding="utf-8")


def verify_manifest(folder: Path) -> list[str]:
    """Re-hash every file listed in a variant's manifest; returns the problems (empty: all files match)."""
    folder = Path(folder)
    listing = read_manifest(folder).output.files
    problems = []
    for name, digest in listing.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name} differs from the manifest")
    listed = set(listing) | {MANIFEST_FILE}
    extra = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                   and p.relative_to(folder).as_posix() not in listed)
    problems.extend(f"{name} is not in the manifest" for name in extra)
    return problems
