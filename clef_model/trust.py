"""Trust for release code: `joint_schema_model.py` is executable Python that comes with a release.

blaze imports it only when its SHA-256 is on the allowlist below (files Cloudflare published), or when
the user opts in explicitly (`trust_release_code=True`, `--trust-release-code` on the CLI). The file is
imported by path under a unique module name, so two releases never share a module and `sys.path` is
never touched.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from clef_model.checkpoint import sha256_file
from clef_model.errors import ReleaseError, UntrustedCodeError

if TYPE_CHECKING:
    from clef_model.release import Release

RELEASE_CODE_FILE = "joint_schema_model.py"

KNOWN_RELEASE_CODE: dict[str, str] = {
    "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3": (
        "Cloudflare joint_schema_model.py (Cloudflare/clef @ 2f3de3dd85f379784083b0814d997ab627200f0c; "
        "shipped unmodified in clef-finetune==0.1.0)"
    ),
}

_loaded: dict[tuple[str, str], ModuleType] = {}


def is_known_release_code(path: Path) -> bool:
    """Whether the file's SHA-256 is on blaze's allowlist of Cloudflare release code."""
    return sha256_file(path) in KNOWN_RELEASE_CODE


def import_release_code_file(path: Path, trust_release_code: bool = False) -> ModuleType:
    """Import a `joint_schema_model.py` by file path, after checking its hash against the allowlist.

    Raises UntrustedCodeError (showing the hash and the opt-in) when the file is not allowlisted and
    `trust_release_code` is False. The same file content is imported once per process.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ReleaseError(f"release code {path} does not exist; the release is incomplete.")
    sha = sha256_file(path)
    if sha not in KNOWN_RELEASE_CODE and not trust_release_code:
        raise UntrustedCodeError(
            f"{path} has SHA-256 {sha}, which is not a known Cloudflare release-code file. "
            "It is executable code: read it, and if you trust it pass --trust-release-code "
            "(trust_release_code=True in the API) to run it."
        )
    key = (str(path), sha)
    if key in _loaded:
        return _loaded[key]
    module_name = f"_blaze_release_code_{sha[:16]}_{len(_loaded)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ReleaseError(f"cannot import release code from {path}.")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve annotations through sys.modules, so the module must be registered while it runs.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ReleaseError(f"release code {path} failed to import: {error}") from error
    _loaded[key] = module
    return module


def load_release_code(release: "Release", trust_release_code: bool = False) -> ModuleType:
    """Import the release's `joint_schema_model.py` (allowlisted hash, or explicit opt-in)."""
    if release.kind != "clef":
        raise ReleaseError(
            f"{release.ref} is a plain causal LM ({release.architecture}); it has no release code or joint head."
        )
    return import_release_code_file(release.path / RELEASE_CODE_FILE, trust_release_code)


def vendored_release_code() -> Path:
    """Path of Cloudflare's release code shipped in `clef-finetune` (checked against the allowlist)."""
    spec = importlib.util.find_spec("clef_finetune")
    if spec is None or not spec.submodule_search_locations:
        raise ReleaseError(
            "the package clef-finetune==0.1.0 (source of Cloudflare's release code) is not installed; "
            "install it with `pip install clef-finetune==0.1.0`."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "_vendor" / RELEASE_CODE_FILE
    if not path.is_file() or not is_known_release_code(path):
        raise ReleaseError(
            f"{path} is missing or is not Cloudflare's release code (hash mismatch); reinstall clef-finetune==0.1.0."
        )
    return path
