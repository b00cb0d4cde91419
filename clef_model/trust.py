"""Trust for release code: `joint_schema_model.py` is executable Python that comes with a release.

blaze runs it only when its SHA-256 is on the allowlist below (files Cloudflare published), or when
the user opts in explicitly (`trust_release_code=True`, `--trust-release-code` on the CLI).

The code that runs is the code that was checked: the file is read once, those bytes are hashed, and the
same bytes are compiled and executed into a fresh module. Python's import system is not used for it, so
no `__pycache__/*.pyc` in the release folder is ever read (a planted bytecode file compiled from a
changed copy cannot stand in for the checked source) and none is written (the base folder stays
byte-identical). Each module gets a unique name, so two releases never share a module and `sys.path` is
never touched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from clef_model.checkpoint import sha256_file
from clef_model.errors import ReleaseError, UntrustedCodeError
from clef_model.files import RELEASE_CODE

if TYPE_CHECKING:
    from clef_model.release import Release

RELEASE_CODE_FILE = RELEASE_CODE

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
    `trust_release_code` is False. The bytes that were hashed are the bytes compiled and run
    (`_exec_source`): bytecode caches are neither read nor written. The same file content is imported
    once per process.
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise ReleaseError(f"release code {path} does not exist; the release is incomplete.")
    try:
        source = path.read_bytes()  # read once: these bytes are hashed, compiled and run
    except OSError as error:
        raise ReleaseError(f"release code {path} cannot be read ({error.strerror}); check its permissions.") from None
    sha = hashlib.sha256(source).hexdigest()
    if sha not in KNOWN_RELEASE_CODE and not trust_release_code:
        raise UntrustedCodeError(
            f"{path} has SHA-256 {sha}, which is not a known Cloudflare release-code file. "
            "It is executable code: read it, and if you trust it pass --trust-release-code "
            "(trust_release_code=True in the API) to run it."
        )
    key = (str(path), sha)
    if key in _loaded:
        return _loaded[key]
    module = _exec_source(source, path, f"_blaze_release_code_{sha[:16]}_{len(_loaded)}")
    _loaded[key] = module
    return module


def _exec_source(source: bytes, path: Path, module_name: str) -> ModuleType:
    """Compile `source` (the checked bytes) and run it as a new module; no bytecode is read or written."""
    try:
        code = compile(source, str(path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as error:
        raise ReleaseError(f"release code {path} is not valid Python ({error}); re-download the release.") from None
    # a spec without a loader: importlib's machinery never touches the release folder for this module
    spec = importlib.util.spec_from_loader(module_name, loader=None, origin=str(path))
    assert spec is not None  # None only when a loader's is_package raises ImportError; this spec has no loader
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    # dataclasses resolve annotations through sys.modules, so the module must be registered while it runs.
    sys.modules[module_name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - allowlisted (or explicitly trusted) release code
    except Exception as error:
        del sys.modules[module_name]
        raise ReleaseError(f"release code {path} failed to import: {error}") from error
    return module


def load_release_code(release: Release, trust_release_code: bool = False) -> ModuleType:
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
