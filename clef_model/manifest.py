"""The `blaze_manifest.json` format: a frozen, versioned `Manifest` that maps to and from its JSON file.

A variant's manifest says what the variant was made from (`base`), with which patch (`patch`), how
(`edit`), what each edited matrix became (`matrices`), with which package versions (`versions`), and the
SHA-256 of every file it holds (`output`). `surgery.manifest` builds and writes it; `canaries`, the card and
`publish` read it here — the type lives in the bottom package because `canaries` and `surgery` never
import each other.

Round trip: `Manifest.from_json(text).to_json() == text` for every file blaze writes, so the same edit
still gives a byte-identical manifest. Each section keeps the keys it does not type (and keys written as
`null`) in its `extra` mapping and writes them back unchanged: the `edit` section in particular holds
whatever the command that made the variant recorded (settings, a strength search table, …) beside the
typed core the readers use.

Versions: `blaze_manifest` is 1. `from_json` refuses a newer or unknown version, and a file that is not a
manifest, with a `BlazeError` that names the bad field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from clef_model.errors import BlazeError
from clef_model.files import MANIFEST_FILE

MANIFEST_VERSION = 1
VERSION_KEY = "blaze_manifest"


def _empty() -> Mapping[str, Any]:
    return MappingProxyType({})


class ManifestError(BlazeError):
    """A manifest that cannot be read: not JSON, not a manifest, a newer version, or a field of the wrong type."""


def freeze(value: Any) -> Any:
    """JSON data made immutable: objects become read-only mappings, arrays tuples (recursively)."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of `freeze`: plain dicts and lists (sections as their dicts), ready for `json.dumps`."""
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


# ---- field checks: each returns the (frozen) value unchanged in type, or raises ManifestError ----------------------


def _fail(where: str, wanted: str, value: Any) -> ManifestError:
    return ManifestError(f"{MANIFEST_FILE}: {where} must be {wanted}, not {json.dumps(value, default=str)[:80]}; "
                         "the file is damaged or was not written by blaze — re-create the variant with blaze edit "
                         "or blaze apply")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, "a string", value)
    return value


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(where, "an integer", value)
    return value


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, "a number", value)
    return value


def _hashes(value: Any, where: str) -> Mapping[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise _fail(where, "an object of name → SHA-256 string", value)
    return MappingProxyType(dict(value))


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(where, "an object", value)
    return freeze(value)


def _integers(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise _fail(where, "a list of integers", value)
    return tuple(value)


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(where, "a list of strings", value)
    return tuple(value)


def _objects(value: Any, where: str) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise _fail(where, "a list of objects", value)
    return freeze(value)


_S = TypeVar("_S", bound="_Section")


class _Section:
    """Shared JSON mapping of the sections: typed fields from `_KEYS`, every other key kept in `extra`.

    `_KEYS` maps a field name to (JSON key, check). A typed field that is None is not written; a key the
    file wrote as null stays in `extra` as null, so a round trip gives the same object back.
    """

    _KEYS: ClassVar[dict[str, tuple[str, Callable[[Any, str], Any]]]] = {}
    extra: Mapping[str, Any]

    @classmethod
    def from_dict(cls: type[_S], raw: Any, where: str) -> _S:
        """The section from its parsed JSON object; ManifestError names a field of the wrong type."""
        return cls._parse(raw, where)

    @classmethod
    def _parse(cls: type[_S], raw: Any, where: str) -> _S:
        if not isinstance(raw, Mapping):
            raise _fail(where, "an object", raw)
        values: dict[str, Any] = {}
        keys = {key: (name, check) for name, (key, check) in cls._KEYS.items()}
        extra = {}
        for key, value in raw.items():
            if key in keys and value is not None:
                name, check = keys[key]
                values[name] = check(value, f"{where}.{key}")
            else:
                extra[key] = value
        return cls(**values, extra=freeze(extra))  # type: ignore[call-arg]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: the `extra` keys, then every typed field that is set."""
        out = thaw(self.extra)
        for name, (key, _check) in self._KEYS.items():
            value = getattr(self, name)
            if value is not None:
                out[key] = thaw(value)
        return out


@dataclass(frozen=True)
class BaseInfo(_Section):
    """The base the variant was made from: its reference, the SHA-256 of each of its files and edited tensors."""

    ref: str | None = None
    revision: str | None = None
    total_size: int | None = None
    files: Mapping[str, str] = field(default_factory=_empty)  # base file name -> SHA-256
    index_file: str | None = None
    index_sha256: str | None = None
    tensor_sha256: Mapping[str, str] = field(default_factory=_empty)  # edited matrix name -> SHA-256 of its stored bytes in the base
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"ref": ("ref", _string), "revision": ("revision", _string), "total_size": ("total_size", _integer),
             "files": ("files", _hashes), "index_file": ("index_file", _string),
             "index_sha256": ("index_sha256", _string), "tensor_sha256": ("tensor_sha256", _hashes)}


@dataclass(frozen=True)
class PatchInfo(_Section):
    """The patch file inside the variant, its metadata and the base identity it records."""

    file: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=_empty)
    base_identity: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"file": ("file", _string), "metadata": ("metadata", _object),
             "base_identity": ("base_identity", _object)}


@dataclass(frozen=True)
class PreservedFile(_Section):
    """One ``blaze edit --preserve-requests`` file: its name, SHA-256, the requests taken into the preserve set
    and those skipped because they carry images (statistics run the text model only)."""

    file: str | None = None
    sha256: str | None = None
    requests: int | None = None
    skipped_images: int | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"file": ("file", _string), "sha256": ("sha256", _string), "requests": ("requests", _integer),
             "skipped_images": ("skipped_images", _integer)}


def _preserved_files(value: Any, where: str) -> tuple[PreservedFile, ...]:
    if not isinstance(value, list):
        raise _fail(where, "a list of preserved request files", value)
    return tuple(PreservedFile.from_dict(item, f"{where}[{i}]") for i, item in enumerate(value))


@dataclass(frozen=True)
class EditInfo(_Section):
    """How the variant was made: a typed core the readers use; whatever else the command recorded is in `extra`.

    `blaze edit` records the behaviour, its spec hash, the method and settings, and the strength search;
    `blaze apply` records `command` and the patch's SHA-256 (and the behaviour and method from the patch).
    """

    behavior: str | None = None
    spec_hash: str | None = None
    method: str | None = None
    strength: float | None = None
    strength_mode: str | None = None
    rank: int | None = None
    lam: float | None = None
    threshold: float | None = None
    layers: tuple[int, ...] | None = None
    kinds: tuple[str, ...] | None = None
    sweep: tuple[Mapping[str, Any], ...] | None = None
    command: str | None = None
    patch_sha256: str | None = None
    preserve_files: tuple[PreservedFile, ...] | None = None  # `blaze edit --preserve-requests` (the user's traffic)
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"behavior": ("behavior", _string), "spec_hash": ("spec_hash", _string), "method": ("method", _string),
             "strength": ("strength", _number), "strength_mode": ("strength_mode", _string),
             "rank": ("rank", _integer), "lam": ("lambda", _number), "threshold": ("threshold", _number),
             "layers": ("layers", _integers), "kinds": ("kinds", _strings), "sweep": ("sweep", _objects),
             "command": ("command", _string), "patch_sha256": ("patch_sha256", _string),
             "preserve_files": ("preserve_files", _preserved_files)}


@dataclass(frozen=True)
class MatrixInfo(_Section):
    """One edited matrix: shape, dtype, rank k and the size of its change."""

    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    k: int | None = None
    numerical_rank: int | None = None
    delta_norm: float | None = None
    weight_norm: float | None = None
    relative_change: float | None = None
    realized_relative_change: float | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"shape": ("shape", _integers), "dtype": ("dtype", _string), "k": ("k", _integer),
             "numerical_rank": ("numerical_rank", _integer), "delta_norm": ("delta_norm", _number),
             "weight_norm": ("weight_norm", _number), "relative_change": ("relative_change", _number),
             "realized_relative_change": ("realized_relative_change", _number)}


@dataclass(frozen=True)
class OutputInfo(_Section):
    """The variant's own files: name -> SHA-256 (every file but the manifest itself) and the weights' total size."""

    total_size: int | None = None
    files: Mapping[str, str] = field(default_factory=_empty)
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"total_size": ("total_size", _integer), "files": ("files", _hashes)}


def _matrices(value: Any, where: str) -> Mapping[str, MatrixInfo]:
    if not isinstance(value, Mapping):
        raise _fail(where, "an object of matrix name → facts", value)
    return MappingProxyType({name: MatrixInfo.from_dict(facts, f"{where}.{name}") for name, facts in value.items()})


def _versions(value: Any, where: str) -> Mapping[str, str | None]:
    if not isinstance(value, Mapping) or not all(v is None or isinstance(v, str) for v in value.values()):
        raise _fail(where, "an object of package → version string or null", value)
    return MappingProxyType(dict(value))


@dataclass(frozen=True)
class Manifest(_Section):
    """A variant's manifest (see the module docstring); `from_json`/`to_json` give back the file's bytes."""

    version: int = MANIFEST_VERSION
    base: BaseInfo = field(default_factory=BaseInfo)
    patch: PatchInfo = field(default_factory=PatchInfo)
    edit: EditInfo = field(default_factory=EditInfo)
    matrices: Mapping[str, MatrixInfo] = field(default_factory=_empty)
    versions: Mapping[str, str | None] = field(default_factory=_empty)
    output: OutputInfo = field(default_factory=OutputInfo)
    edited_tensors: tuple[str, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=_empty)
    _KEYS = {"version": (VERSION_KEY, _integer), "base": ("base", BaseInfo.from_dict),
             "patch": ("patch", PatchInfo.from_dict), "edit": ("edit", EditInfo.from_dict),
             "matrices": ("matrices", _matrices), "versions": ("versions", _versions),
             "output": ("output", OutputInfo.from_dict), "edited_tensors": ("edited_tensors", _strings)}

    @classmethod
    def from_dict(cls, raw: Any, where: str = MANIFEST_FILE) -> Manifest:
        """A manifest from parsed JSON; ManifestError for another version or a field of the wrong type."""
        if not isinstance(raw, Mapping) or VERSION_KEY not in raw:
            raise ManifestError(f"{where}: not a blaze manifest (no {VERSION_KEY!r} version field); pass a folder "
                                "written by blaze edit or blaze apply")
        version = raw[VERSION_KEY]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ManifestError(f"{where}: unknown manifest version {version!r}; this blaze reads version "
                                f"{MANIFEST_VERSION}")
        if version > MANIFEST_VERSION:
            raise ManifestError(f"{where}: manifest version {version} was written by a newer blaze (this one reads "
                                f"version {MANIFEST_VERSION}); upgrade blaze to read this variant")
        return cls._parse(raw, "manifest")

    @classmethod
    def from_json(cls, text: str | bytes, where: str = MANIFEST_FILE) -> Manifest:
        """Parse a manifest file's text; ManifestError when it is not JSON or not a manifest this blaze reads."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ManifestError(f"{where} is not valid JSON ({error}); the variant folder is damaged — re-create "
                                "it with blaze edit or blaze apply") from None
        return cls.from_dict(raw, where)

    def to_json(self) -> str:
        """The file's text: sorted, indented JSON ending in a newline (stable bytes for the same content)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str) + "\n"

    @property
    def behavior(self) -> str | None:
        """The behaviour the variant was made for (`edit.behavior`), when recorded."""
        return self.edit.behavior

    def file_hashes(self) -> Mapping[str, str]:
        """Output file name -> SHA-256 (every file of the variant except the manifest itself)."""
        return self.output.files


def read_manifest(folder: Path) -> Manifest:
    """Read a variant's manifest; ManifestError when it is missing, not JSON, or not a manifest this blaze reads."""
    path = Path(folder) / MANIFEST_FILE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path} not found: {folder} is not a blaze variant (or its manifest was removed)") \
            from None
    except OSError as error:
        raise ManifestError(f"{path}: cannot read it ({error.strerror})") from None
    return Manifest.from_json(text, str(path))


def find_manifest(folder: Path) -> Manifest | None:
    """A folder's manifest, or None when it has none (a base release); a damaged one is a ManifestError."""
    return read_manifest(folder) if (Path(folder) / MANIFEST_FILE).is_file() else None


__all__ = ["MANIFEST_FILE", "MANIFEST_VERSION", "BaseInfo", "EditInfo", "Manifest", "ManifestError", "MatrixInfo",
           "OutputInfo", "PatchInfo", "find_manifest", "freeze", "read_manifest", "thaw"]
