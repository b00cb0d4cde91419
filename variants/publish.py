"""Publish a variant folder to the Hugging Face Hub, after checking it is what its manifest says.

Checks before anything is uploaded (any failure refuses, unless ``force``):

- ``blaze_manifest.json`` is present and lists the output files; every listed file exists and its
  SHA-256 matches; no file outside the list would be uploaded (besides the card and the canary reports);
- ``blaze_canary.json`` is present, belongs to these weights, its gate passed and its integrity check
  passed. It belongs to these weights when it is the report ``blaze edit`` wrote (its SHA-256 is listed in
  the manifest) or when it records this folder's manifest SHA-256 (``blaze canary`` writes it into
  ``meta``; the manifest holds every file's hash, so that binds the report to the weights). A report
  copied from another variant is refused. A report without an integrity verdict (``blaze edit`` runs its
  canary before the folder exists) falls back to a file-level check from the manifest
  (``canaries.integrity.side_file_integrity``): every side file (joint head, release code, tokenizer, ...)
  equals the base's.

Then the card is rendered (``README.md``, the one file that is not hash-checked: it is regenerated here)
and the folder goes up with ``huggingface_hub`` (``create_repo(exist_ok=True)``, ``create_branch`` for a
new ``revision``, then ONE ``create_commit`` of every verified file plus the card from memory; the library
uploads large files first and shows progress). One commit is atomic on the Hub: a run killed at any point
leaves either no new commit or the whole upload, never a repo that holds part of the variant (``upload_folder``
would commit a large folder in several batches when ``hf_xet`` is installed). The card is written into the
folder only after the commit succeeded, so a failed or killed upload leaves the folder as it was.

The token is read from the environment (``--token-env``, default ``HF_TOKEN``) or huggingface_hub's
stored login, and only ever handed to ``HfApi``: it is never printed, logged, or written to a file.
``HF_ENDPOINT`` points the client at another Hub (the tests use a local stand-in server).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from canaries.integrity import report_manifest_sha256, side_file_integrity
from clef_model import env
from clef_model.checkpoint import sha256_file
from clef_model.errors import BlazeError
from clef_model.files import CANARY_JSON, CANARY_MD, CARD_FILE, MANIFEST_FILE
from clef_model.manifest import Manifest, find_manifest
from variants.card import read_json, render_card

CARD = CARD_FILE
# Files that may sit beside the manifest's list: the manifest itself, the canary reports (they can be
# written after the manifest), and the card (regenerated on every publish).
UNLISTED_OK = {MANIFEST_FILE, CANARY_JSON, CANARY_MD, CARD}


@dataclass
class Verification:
    """What ``verify_variant`` found: files to upload (relative path, size) and problems (empty = fine)."""

    folder: Path
    files: list[tuple[str, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
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


def folder_files(folder: Path) -> list[tuple[str, int]]:
    """Every regular file under ``folder`` as (posix relative path, size); hidden entries skipped."""
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        files.append((relative.as_posix(), path.stat().st_size))
    return files


def report_binding(folder: Path, manifest: Manifest, report: dict[str, Any]) -> tuple[bool, str | None]:
    """(bound by ``meta``, problem): whether the canary report belongs to the weights the manifest describes.

    The report ``blaze edit`` wrote is listed in the manifest (its SHA-256 checked like any file); a report
    of ``blaze canary`` records the SHA-256 of the manifest of the variant it ran on. Anything else — a
    report copied from another variant, or one that does not say which weights it measured — is a problem.
    """
    listed = manifest.output.files.get(CANARY_JSON)
    if listed is not None and sha256_file(folder / CANARY_JSON) == listed:
        return False, None
    rerun = (f"re-run `blaze canary {folder} --json {folder / CANARY_JSON} --markdown {folder / CANARY_MD}` "
             "on these weights")
    recorded = report_manifest_sha256(report)
    if recorded is None:
        return False, (f"{CANARY_JSON} does not record which weights it was run on (not the report blaze edit "
                       f"wrote for this folder, and no variant manifest SHA-256 in it): {rerun}")
    actual = sha256_file(folder / MANIFEST_FILE)
    if recorded != actual:
        return False, (f"{CANARY_JSON} belongs to other weights: it was run on the variant whose manifest has "
                       f"SHA-256 {recorded[:12]}…, this folder's manifest has {actual[:12]}…; {rerun}")
    return True, None


def _check_files(folder: Path, manifest: Manifest, result: Verification, report_rerun: bool) -> None:
    """Every listed file present with its SHA-256, and no unlisted file (problems into ``result``)."""
    listed = manifest.output.files
    if not listed:
        result.problems.append(f"{MANIFEST_FILE} lists no output files with SHA-256: cannot verify the folder")
        return
    skip = {CARD, CANARY_JSON} | ({CANARY_MD} if report_rerun else set())  # the card is regenerated here;
    # the report is checked by report_binding (a later `blaze canary` run replaces the edit's)
    for name, expected in sorted(listed.items()):
        if name in skip:
            continue
        path = folder / name
        if not path.is_file():
            result.problems.append(f"{name}: listed in the manifest but missing from the folder")
        elif sha256_file(path) != expected:
            result.problems.append(f"{name}: SHA-256 differs from the manifest's (the file or {MANIFEST_FILE} "
                                   "was altered or damaged after blaze wrote them)")
    present = {name for name, _ in result.files}
    for name in sorted(present - set(listed) - UNLISTED_OK):
        result.problems.append(f"{name}: not listed in the manifest (an unverified file would be uploaded)")


def _check_report(report: dict[str, Any], manifest: Manifest | None, result: Verification) -> None:
    """Gate and integrity verdicts of the canary report (problems and notes into ``result``)."""
    gate = report.get("gate")
    if not isinstance(gate, dict) or gate.get("passed") is not True:
        checks = gate.get("checks") if isinstance(gate, dict) else None
        failed = [c.get("name", "?") for c in (checks if isinstance(checks, list) else [])
                  if isinstance(c, dict) and c.get("passed") is False]
        result.problems.append("the canary gate did not pass"
                               + (f" (failed: {', '.join(map(str, failed))})" if failed else ""))
    integrity = report.get("integrity")
    integrity = integrity if isinstance(integrity, dict) else {}
    verdict = integrity.get("passed")
    if verdict is False:
        problems = integrity.get("problems") or ["see report"]
        result.problems.append("the canary integrity check failed: " + "; ".join(map(str, problems)))
    elif verdict is None and manifest is not None:
        passed, problems = side_file_integrity(manifest)
        result.notes.append("integrity: the canary report has no integrity check; side files checked "
                            "against the base hashes in the manifest: " + ("identical" if passed else "DIFFER"))
        result.problems += [f"integrity: {p}" for p in problems]
    elif verdict is None:
        result.problems.append("the canary report has no integrity verdict")


def verify_variant(variant_dir: Path) -> Verification:
    """Check a variant folder against its manifest and canary report; never raises for a bad variant."""
    folder = Path(variant_dir)
    if not folder.is_dir():
        raise BlazeError(f"variant folder not found: {folder}; pass the folder `blaze edit --out` wrote")
    result = Verification(folder=folder, files=[f for f in folder_files(folder) if f[0] != CARD])
    result.manifest = manifest = find_manifest(folder)
    result.report = report = read_json(folder / CANARY_JSON)
    rerun = False
    if manifest is not None and report is not None:
        rerun, binding = report_binding(folder, manifest, report)
        if binding:
            result.problems.append(binding)
    if manifest is None:
        result.problems.append(f"{MANIFEST_FILE} is missing: this folder was not written by `blaze edit`/`blaze apply`")
    else:
        _check_files(folder, manifest, result, rerun)
    if report is None:
        result.problems.append(f"{CANARY_JSON} is missing: run `blaze canary {folder} --against BASE --json "
                               f"{folder / CANARY_JSON} --markdown {folder / CANARY_MD}` first")
    else:
        _check_report(report, manifest, result)
    return result


def _size(n: float) -> str:
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

    from huggingface_hub import CommitOperationAdd, HfApi, constants
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    if constants.is_offline_mode():
        raise BlazeError("HF_HUB_OFFLINE is set: publishing needs the Hub; unset it, or use --dry-run")
    token = resolve_token(token_env)
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    quiet = env.quiet() and not are_progress_bars_disabled()
    if quiet:
        disable_progress_bars()
    behaviour = check.manifest.behavior if check.manifest is not None else None
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name, _ in check.files]
    operations.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode("utf-8")))
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        echo(f"repo: {url}")
        if branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True, repo_type="model")
        info = api.create_commit(
            repo_id=repo_id, operations=operations, revision=branch, repo_type="model",
            commit_message=f"blaze: publish {behaviour + ' ' if behaviour else ''}variant",
        )
    except BaseException as error:  # noqa: BLE001 - re-raised as a BlazeError or unchanged
        _raise_upload_error(error, repo_id, api.endpoint)
    finally:
        if quiet:
            enable_progress_bars()
    _write_card_text(folder / CARD, card)
    result.commit_url = getattr(info, "commit_url", None) or str(info)
    echo(f"published {len(operations)} files to {repo_id}@{branch}: {result.commit_url}")
    return result


def _write_card_text(card_path: Path, card: str) -> None:
    """Write the uploaded card into the folder atomically (temp file + rename; the temp is hidden, never uploaded)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{card_path.name}.", dir=card_path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(card)
        os.chmod(tmp, 0o644)
        os.replace(tmp, card_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _raise_upload_error(error: BaseException, repo_id: str, endpoint: str) -> NoReturn:
    """Re-raise a failed upload as a BlazeError that says what to do (other exceptions unchanged)."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        hint = (" — check the token has write access to this namespace (`hf auth login`)" if status in (401, 403)
                else "")
        raise BlazeError(f"upload to {repo_id} failed (HTTP {status}): {error.server_message or error}{hint}") from None
    if isinstance(error, (ConnectionError, OSError)):
        raise BlazeError(f"cannot reach the Hub at {endpoint}: {error}") from None
    raise error
