"""Resolve what the user names as a model into a validated local release folder.

A reference is a local folder, the embedded name `smollm2`, or a Hugging Face Hub id (with an optional
revision), downloaded with `huggingface_hub.snapshot_download` restricted to the release's files. The
layout is checked before anything loads, so an incomplete download or a missing shard gives one error
that lists everything missing, instead of a traceback from deep inside transformers.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from clef_model.checkpoint import INDEX_NAME, SINGLE_NAME
from clef_model.errors import ReleaseError
from clef_model.files import JOINT_HEAD, RELEASE_CODE

DEFAULT_BASE = "Cloudflare/clef-flash"
EMBEDDED_NAME = "smollm2"

# Files a Hub download fetches: everything a release needs, nothing else (no README images, no .bin).
RELEASE_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.py",
    "*.txt",
    "*.model",
    "LICENSE*",
]

CLEF_REQUIRED = [
    JOINT_HEAD,
    "joint_head_config.json",
    RELEASE_CODE,
]
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
PROCESSOR_ANY = ["processor_config.json", "preprocessor_config.json"]

# config.json model_type -> blaze architecture name
_ARCHITECTURES = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5_text",
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
}


@dataclass(frozen=True)
class Release:
    """A validated release on local disk and how it was named."""

    path: Path
    ref: str
    revision: str | None
    kind: str  # "clef" (joint head + release code) or "causal_lm"
    architecture: str  # "qwen3_5", "qwen3_5_text", "llama", "qwen2", "qwen3", "gemma3"

    def config(self) -> dict:
        """The parsed config.json."""
        return json.loads((self.path / "config.json").read_text(encoding="utf-8"))

    def weight_map(self) -> dict[str, str]:
        """Tensor name -> shard file name (a single-file checkpoint maps every tensor to model.safetensors)."""
        index = self.path / INDEX_NAME
        if index.is_file():
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        from clef_model.checkpoint import CheckpointReader

        return CheckpointReader(self.path).weight_map()

    def side_files(self) -> list[str]:
        """Every non-weight file of the release, as sorted relative names, junk excluded (`is_junk`)."""
        weights = set(self.weight_map().values()) | {INDEX_NAME}
        files = []
        for path in sorted(self.path.rglob("*")):
            relative = path.relative_to(self.path)
            if not path.is_file() or is_junk(relative.as_posix()):
                continue
            if str(relative) not in weights:
                files.append(str(relative))
        return files


# Files that are never part of a release, so never copied into a variant, listed in a manifest or uploaded:
# hidden files and folders (.DS_Store, .git, .cache, editor swap files such as .x.swp), Python bytecode
# (__pycache__/, *.pyc, *.pyo: the release code is run from its checked source only), editor backups
# (x~, #x#, *.bak, *.orig, *.rej, *.swp, *.tmp) and desktop metadata (Thumbs.db, desktop.ini). A denylist,
# not an allowlist: releases legitimately carry files blaze does not know (a README, extra configs).
_JUNK_DIRS = {"__pycache__"}
_JUNK_NAMES = {"thumbs.db", "desktop.ini"}
_JUNK_SUFFIXES = (".pyc", ".pyo", ".bak", ".orig", ".rej", ".swp", ".swo", ".tmp", "~")


def is_junk(relative: str) -> bool:
    """Whether a file (POSIX path relative to the release folder) is junk rather than part of the release."""
    parts = relative.split("/")
    name = parts[-1]
    return (any(part.startswith(".") or part in _JUNK_DIRS for part in parts)
            or name.lower() in _JUNK_NAMES or name.lower().endswith(_JUNK_SUFFIXES)
            or (name.startswith("#") and name.endswith("#")))


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ReleaseError(f"{path} is not readable JSON ({error}); the release is damaged, re-download it.") from None


def detect_architecture(config: dict) -> str:
    """The blaze architecture name from a config.json (model_type, then architectures)."""
    model_type = config.get("model_type")
    if model_type in _ARCHITECTURES:
        return _ARCHITECTURES[model_type]
    architectures = " ".join(config.get("architectures") or [])
    for prefix, name in (
        ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
        ("Qwen3_5ForCausalLM", "qwen3_5_text"),
        ("Llama", "llama"),
        ("Qwen2", "qwen2"),
        ("Qwen3", "qwen3"),
        ("Gemma3ForCausalLM", "gemma3"),
    ):
        if prefix in architectures:
            return name
    raise ReleaseError(
        f"unsupported model (model_type {model_type!r}, architectures {architectures or 'none'}); blaze runs "
        "Clef/Qwen3.5 releases and Llama, Qwen2, Qwen3, Qwen3.5 and Gemma 3 (text) causal LMs."
    )


def validate_layout(path: Path) -> tuple[str, str]:
    """Check that `path` holds a complete release; returns (kind, architecture).

    Raises one ReleaseError listing every missing file: config, weights (index and every shard it names,
    or a single model.safetensors), tokenizer, and for Clef releases the joint head, release code,
    processor files and chat template.
    """
    missing: list[str] = []
    config_path = path / "config.json"
    if not config_path.is_file():
        missing.append("config.json")
    if (path / INDEX_NAME).is_file():
        index = _read_json(path / INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ReleaseError(f"{path / INDEX_NAME} has no weight_map; the release is damaged, re-download it.")
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                missing.append(f"{shard} (named by {INDEX_NAME})")
    elif not (path / SINGLE_NAME).is_file():
        missing.append(f"{INDEX_NAME} or {SINGLE_NAME}")
    is_clef = (path / "joint_head_config.json").is_file()
    if is_clef:
        missing += [name for name in CLEF_REQUIRED + TOKENIZER_FILES if not (path / name).is_file()]
        if not any((path / name).is_file() for name in PROCESSOR_ANY):
            missing.append("processor_config.json or preprocessor_config.json")
        if not (path / "chat_template.jinja").is_file() and not _tokenizer_has_template(path):
            missing.append("chat_template.jinja")
    elif not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer.json or tokenizer_config.json")
    if missing:
        raise ReleaseError(
            f"{path} is not a complete release; missing: {', '.join(missing)}. "
            "Re-download it, or pass a local folder that holds every release file."
        )
    architecture = detect_architecture(_read_json(config_path))
    if is_clef and architecture != "qwen3_5":
        raise ReleaseError(
            f"{path} has a joint head but a {architecture} backbone; Clef releases are Qwen3.5 "
            "(Qwen3_5ForConditionalGeneration)."
        )
    return ("clef" if is_clef else "causal_lm"), architecture


def _tokenizer_has_template(path: Path) -> bool:
    config = path / "tokenizer_config.json"
    return config.is_file() and bool(_read_json(config).get("chat_template"))


def _looks_like_hub_id(ref: str) -> bool:
    parts = ref.split("/")
    return len(parts) == 2 and all(parts) and not ref.startswith((".", "/", "~"))


def _download(repo_id: str, revision: str | None) -> tuple[Path, str | None]:
    """snapshot_download of the release's files; offline or unknown repo -> ReleaseError."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=RELEASE_PATTERNS)
    except RevisionNotFoundError:
        raise ReleaseError(f"{repo_id} has no revision {revision!r}; check the --revision value.") from None
    except GatedRepoError:
        raise ReleaseError(
            f"{repo_id} is gated: accept its terms on the Hub and log in (`hf auth login`), or pass a local folder."
        ) from None
    except RepositoryNotFoundError:
        raise ReleaseError(
            f"{repo_id} was not found on the Hugging Face Hub (or is private); check the name, "
            "log in for private repositories, or pass a local folder."
        ) from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise ReleaseError(
            f"cannot download {repo_id}: {why} and it is not in the local Hugging Face cache. "
            "Connect to the network, or pass a local folder holding the release "
            "(or use the embedded base `smollm2`)."
        ) from None
    except OSError as error:
        raise ReleaseError(
            f"cannot download {repo_id} ({error}); check the network, or pass a local folder holding the release."
        ) from None
    snapshot = Path(folder)
    return snapshot, snapshot.name  # snapshot folders are named by the resolved commit


def resolve_release(ref: str | Path, revision: str | None = None) -> Release:
    """Turn a folder, `smollm2`, or a Hub id (+ revision) into a validated local Release."""
    text = str(ref)
    from clef_model.embedded import embedded_aliases, embedded_release_path

    if text in embedded_aliases():
        path = embedded_release_path(text)
        resolved_revision = None
    elif Path(text).expanduser().is_dir():
        path = Path(text).expanduser().resolve()
        resolved_revision = None
    elif _looks_like_hub_id(text):
        path, resolved_revision = _download(text, revision)
    else:
        raise ReleaseError(
            f"{text!r} is neither a folder nor a Hub id (owner/name) nor an embedded model "
            f"({', '.join(embedded_aliases())}); "
            "pass a local release folder or a Hub id such as Cloudflare/clef-flash."
        )
    kind, architecture = validate_layout(path)
    from clef_model.outputs import check_cache_outside

    check_cache_outside(path)
    return Release(path=path, ref=text, revision=resolved_revision, kind=kind, architecture=architecture)
