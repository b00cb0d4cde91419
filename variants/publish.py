"""Publish a variant folder to the Hugging Face Hub, after checking it is what its manifest says.

Checks before anything is uploaded (any failure refuses, unless ``force``):

- ``blaze_manifest.json`` is present and lists the output files; every listed file exists and its
  SHA-256 matches; no file outside the list would be uploaded (besides the card and the canary reports);
- ``blaze_canary.json`` is present, its gate passed and its integrity check passed. A report without an
  integrity verdict (``blaze edit`` runs its canary before the folder exists) falls back to a file-level
  check from the manifest: every side file (joint head, release code, tokenizer, ...) equals the base's.

Then the card is rendered into ``README.md`` (the one file that is not hash-checked: it is regenerated
here) and the folder goes up with ``huggingface_hub`` (``create_repo(exist_ok=True)``, ``create_branch``
for a new ``revision``, ``upload_folder``; the library handles large files and shows progress).

The token is read from the environment (``--token-env``, default ``HF_TOKEN``) or huggingface_hub's
stored login, and only ever handed to ``HfApi``: it is never printed, logged, or written to a file.
``HF_ENDPOINT`` points the client at another Hub (the tests use a local stand-in server).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clef_model.errors import BlazeError
from variants.card import CANARY_JSON, CANARY_MD, MANIFEST, lookup, read_json, render_card, write_card

CARD = "README.md"
# Files that may sit beside the manifest's list: the manifest itself, the canary reports (they can be
# written after the manifest), and the card (regenerated on every publish).
UNLISTED_OK = {MANIFEST, CANARY_JSON, CANARY_MD, CARD}


@dataclass
class Verification:
    """What ``verify_variant`` found: files to upload (relative path, size) and problems (empty = fine)."""

    folder: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    report: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class PublishResult:
    """Outcome of ``publish``: the repo, branch, uploaded files and, unless a dry run, the commit URL."""

    repo_id: str
    revision: str
    files: list[tuple[str, int]]
    card: str
    dry_run: bool
    forced_past: list[str]
    commit_url: str | None = None


def manifest_file_hashes(manifest: dict[str, Any]) -> dict[str, str] | None:
    """Output file -> SHA-256 from a manifest (several shapes accepted); None when it lists none."""
    listing = lookup(manifest, "output.files", "outputs", "output_files", "files")
    if isinstance(listing, dict):
        out = {}
        for name, value in listing.items():
            sha = value if isinstance(value, str) else lookup(value, "sha256") if isinstance(value, dict) else None
            if isinstance(sha, str):
                out[str(name)] = sha.lower()
        return out or None
    if isinstance(listing, list):
        out = {}
        for entry in listing:
            if isinstance(entry, dict):
                name = lookup(entry, "path", "name", "file")
                sha = lookup(entry, "sha256")
                if isinstance(name, str) and isinstance(sha, str):
                    out[name] = sha.lower()
        return out or None
    return None


def side_file_integrity(manifest: dict[str, Any]) -> tuple[bool, list[str]]:
    """File-level integrity from the manifest alone: every side file equals the base's.

    The manifest records the SHA-256 of each base input file (``base.files``) and of each output file
    (``output.files``). Weight shards and their index legitimately differ; everything else (joint head,
    release code, tokenizer, configs, LICENSE) must be byte-identical, and a Clef release's joint head and
    release code must be present. This runs when the canary report carries no integrity verdict (``blaze
    edit`` runs its canary before the folder exists); it does not compare tensors with the base.
    """
    base_files = lookup(manifest, "base.files")
    out_files = manifest_file_hashes(manifest) or {}
    if not isinstance(base_files, dict) or not base_files:
        return False, ["the manifest records no base file hashes: no integrity check is possible"]
    problems = []
    for name, digest in sorted(base_files.items()):
        if name == CARD or _is_weight_file(name):
            continue
        if name not in out_files:
            problems.append(f"{name}: in the base but not in the variant")
        elif out_files[name] != str(digest).lower():
            problems.append(f"{name}: differs from the base's (SHA-256)")
    if "joint_head.safetensors" in base_files:
        for name in ("joint_head.safetensors", "joint_schema_model.py"):
            if name not in base_files or name not in out_files:
                problems.append(f"{name}: missing, so the typed-decision path cannot be trusted")
    return not problems, problems


def _is_weight_file(name: str) -> bool:
    return name.endswith(".safetensors") and name.startswith("model") or name == "model.safetensors.index.json"


def folder_files(folder: Path) -> list[tuple[str, int]]:
    """Every regular file under ``folder`` as (posix relative path, size); hidden entries skipped."""
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        files.append((relative.as_posix(), path.stat().st_size))
    return files


def verify_variant(variant_dir: Path) -> Verification:
    """Check a variant folder against its manifest and canary report; never raises for a bad variant."""
    from clef_model.checkpoint import sha256_file

    folder = Path(variant_dir)
    if not folder.is_dir():
        raise BlazeError(f"variant folder not found: {folder}; pass the folder `blaze edit --out` wrote")
    result = Verification(folder=folder, files=[f for f in folder_files(folder) if f[0] != CARD])
    result.manifest = read_json(folder / MANIFEST)
    result.report = read_json(folder / CANARY_JSON)

    if result.manifest is None:
        result.problems.append(f"{MANIFEST} is missing: this folder was not written by `blaze edit`/`blaze apply`")
    else:
        listed = manifest_file_hashes(result.manifest)
        if listed is None:
            result.problems.append(f"{MANIFEST} lists no output files with SHA-256: cannot verify the folder")
        else:
            present = {name for name, _ in result.files}
            for name, expected in sorted(listed.items()):
                if name == CARD:
                    continue  # regenerated by publish
                path = folder / name
                if not path.is_file():
                    result.problems.append(f"{name}: listed in the manifest but missing from the folder")
                elif sha256_file(path) != expected:
                    result.problems.append(f"{name}: SHA-256 differs from the manifest (file changed after the edit)")
            for name in sorted(present - set(listed) - UNLISTED_OK):
                result.problems.append(f"{name}: not listed in the manifest (an unverified file would be uploaded)")

    report = result.report
    if report is None:
        result.problems.append(f"{CANARY_JSON} is missing: run `blaze canary {folder} --against BASE --json "
                               f"{folder / CANARY_JSON} --markdown {folder / CANARY_MD}` first")
    else:
        gate = report.get("gate")
        if not isinstance(gate, dict) or gate.get("passed") is not True:
            failed = [lookup(c, "name", "check", default="?") for c in (lookup(gate, "checks", default=[]) or [])
                      if isinstance(c, dict) and c.get("passed") is False]
            result.problems.append("the canary gate did not pass"
                                   + (f" (failed: {', '.join(map(str, failed))})" if failed else ""))
        integrity = report.get("integrity")
        verdict = lookup(integrity, "passed", "ok") if isinstance(integrity, dict) else None
        if verdict is False:
            result.problems.append("the canary integrity check failed: "
                                   + "; ".join(map(str, lookup(integrity, "problems", default=[]) or ["see report"])))
        elif verdict is None and result.manifest is not None:
            passed, problems = side_file_integrity(result.manifest)
            result.notes.append("integrity: the canary report has no integrity check; side files checked "
                                "against the base hashes in the manifest: " + ("identical" if passed else "DIFFER"))
            result.problems += [f"integrity: {p}" for p in problems]
        elif verdict is None:
            result.problems.append("the canary report has no integrity verdict")
    return result


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def describe_files(files: list[tuple[str, int]], card: str) -> list[str]:
    """File list lines for the dry run: name and size, the card last, then the total."""
    width = max([len(name) for name, _ in files] + [len(CARD)])
    lines = [f"  {name:<{width}}  {_size(size):>9}" for name, size in files]
    card_size = len(card.encode("utf-8"))
    lines.append(f"  {CARD:<{width}}  {_size(card_size):>9}  (model card, generated)")
    total = sum(size for _, size in files) + card_size
    lines.append(f"  {len(files) + 1} files, {_size(total)} in all")
    return lines


def resolve_token(token_env: str = "HF_TOKEN") -> str | None:
    """The token from ``token_env``, else huggingface_hub's login; raises when there is none."""
    value = os.environ.get(token_env)
    if value:
        return value
    if token_env != "HF_TOKEN":
        raise BlazeError(f"environment variable {token_env} is not set: export the Hub token there, "
                         "or omit --token-env to use HF_TOKEN / `hf auth login`")
    from huggingface_hub import get_token

    if get_token() is None:
        raise BlazeError("no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)")
    return None  # huggingface_hub finds the stored login itself


def check_repo_id(repo_id: str) -> None:
    """Refuse a repo id that is not ``namespace/name`` in the Hub's allowed characters."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise BlazeError(f"invalid repo id {repo_id!r}: {error}") from None
    if repo_id.count("/") != 1:
        raise BlazeError(f"invalid repo id {repo_id!r}: use NAMESPACE/NAME, e.g. you/clef-flash-concise")


def publish(variant_dir: Path, repo_id: str, *, private: bool = False, revision: str | None = None,
            dry_run: bool = False, force: bool = False, token_env: str = "HF_TOKEN", endpoint: str | None = None,
            echo: Callable[[str], None] = print) -> PublishResult:
    """Verify, render the card, and upload ``variant_dir`` to ``repo_id`` (see the module docstring).

    ``dry_run`` prints the file list and the card and touches neither the folder nor the network.
    """
    folder = Path(variant_dir)
    check_repo_id(repo_id)
    check = verify_variant(folder)
    if check.problems and not force:
        raise BlazeError(f"refusing to publish {folder}:\n  - " + "\n  - ".join(check.problems)
                         + "\nfix these (or pass --force to publish anyway)")
    for note in check.notes:
        echo(note)
    for problem in check.problems:
        echo(f"warning (--force): {problem}")
    branch = revision or "main"
    card = render_card(folder, repo_id)
    result = PublishResult(repo_id, branch, check.files + [(CARD, len(card.encode("utf-8")))], card, dry_run,
                           list(check.problems))

    if dry_run:
        echo(f"dry run: would upload {folder} to {repo_id} (branch {branch}{', private' if private else ''}):")
        for line in describe_files(check.files, card):
            echo(line)
        echo("")
        echo(card)
        return result

    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if constants.is_offline_mode():
        raise BlazeError("HF_HUB_OFFLINE is set: publishing needs the Hub; unset it, or use --dry-run")
    token = resolve_token(token_env)
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    write_card(folder, repo_id)
    quiet = os.environ.get("BLAZE_QUIET") == "1" and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    behaviour = lookup(check.manifest, "behavior.name", "behavior", "extra.behavior", "metadata.behavior")
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        echo(f"repo: {url}")
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True, repo_type="model")
        names = [name for name, _ in check.files] + [CARD]
        info = api.upload_folder(
            repo_id=repo_id, folder_path=folder, revision=branch, repo_type="model",
            allow_patterns=[glob.escape(name) for name in names],
            commit_message=f"blaze: publish {behaviour + ' ' if isinstance(behaviour, str) else ''}variant",
        )
    except HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", None)
        hint = (" — check the token has write access to this namespace (`hf auth login`)" if status in (401, 403)
                else "")
        raise BlazeError(f"upload to {repo_id} failed (HTTP {status}): {error.server_message or error}{hint}") from None
    except (ConnectionError, OSError) as error:
        raise BlazeError(f"cannot reach the Hub at {api.endpoint}: {error}") from None
    finally:
        if quiet:
            enable_progress_bars()
    result.commit_url = getattr(info, "commit_url", None) or str(info)
    echo(f"published {len(names)} files to {repo_id}@{branch}: {result.commit_url}")
    return result
