"""`blaze_manifest.json`: what a variant was made from, how, and the hash of every file it holds.

The manifest is written last by `surgery.write.write_variant`. It holds no timestamps, so the same edit
of the same base gives the same manifest (and `blaze apply` re-creates it). `verify_manifest` re-hashes a
variant folder against it.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path

from clef_model.checkpoint import sha256_file
from clef_model.errors import BlazeError

MANIFEST_FILE = "blaze_manifest.json"
MANIFEST_VERSION = 1
_PACKAGES = ("blaze", "numpy", "ml_dtypes", "torch", "transformers", "safetensors", "huggingface_hub", "peft",
             "clef-finetune")


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
) -> dict:
    """Assemble the manifest dict (see module docstring); every value JSON-serialisable."""
    return {
        "blaze_manifest": MANIFEST_VERSION,
        "base": base,
        "patch": {"file": patch_file, "metadata": patch_metadata, "base_identity": base_identity},
        "edit": edit or {},
        "matrices": matrices,
        "versions": package_versions(),
        "output": {"total_size": output_total_size, "files": dict(sorted(output_files.items()))},
    }


def write_manifest(path: Path, manifest: dict) -> None:
    """Write the manifest as sorted, indented JSON (stable bytes for the same content)."""
    Path(path).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def read_manifest(folder: Path) -> dict:
    """Read a variant's manifest; BlazeError when it is missing or not JSON."""
    path = Path(folder) / MANIFEST_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BlazeError(f"{path} not found: {folder} is not a blaze variant (or its manifest was removed).") from None
    except json.JSONDecodeError as error:
        raise BlazeError(f"{path} is not valid JSON ({error}); the variant folder is damaged.") from None


def verify_manifest(folder: Path) -> list[str]:
    """Re-hash every file listed in a variant's manifest; returns the problems (empty: all files match)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    problems = []
    for name, digest in manifest.get("output", {}).get("files", {}).items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != digest:
            problems.append(f"{name} differs from the manifest")
    from clef_model.outputs import MARKER  # blaze's own hidden "written by blaze" marker is not content

    listed = set(manifest.get("output", {}).get("files", {})) | {MANIFEST_FILE, MARKER}
    extra = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                   and p.relative_to(folder).as_posix() not in listed)
    problems.extend(f"{name} is not in the manifest" for name in extra)
    return problems
