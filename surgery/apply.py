"""`blaze apply`'s domain logic: a saved patch + a base release -> a variant folder, by streaming.

Torch-free (numpy + ml_dtypes through `surgery.delta` and `surgery.write`), so `blaze apply` stays far
below the ≈ 700 MiB `import torch` costs. The CLI command (`variants/cli/apply.py`) only parses options,
calls `apply_patch` and prints its result.

The checks, in order, before a byte is written:
1. the output folder is writable and, when not empty, replaceable (`--force` over blaze's own output only);
2. the patch's factors are finite (a NaN/inf factor is the patch's fault, and is blamed on it);
3. the patch edits only tensors its recorded base identity lists (a patch that also edits, say,
   `embed_tokens` without a recorded hash for it is refused: nothing would check that tensor's base);
4. the base's checkpoint index matches the recorded one (`force` turns this into a warning).
The edited tensors' recorded hashes are then verified as they stream (`write_variant(expect_tensor_sha256)`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clef_model.checkpoint import sha256_file
from clef_model.errors import BlazeError
from clef_model.outputs import check_apart_from_base, check_output_folders
from clef_model.release import DEFAULT_BASE, Release, resolve_release
from surgery.delta import BaseMismatchError, PatchArrays, check_identity, patch_path, trusted_tensor_sha256
from surgery.manifest import read_manifest
from surgery.write import write_variant


@dataclass
class ApplyResult:
    """What `apply_patch` wrote and found."""

    out: Path
    release: Release
    patch: PatchArrays
    patch_file: Path
    matrices: int  # edited matrices
    ranks: list[int]  # distinct numerical ranks of the edits
    max_relative_change: float  # largest ‖ΔW‖/‖W‖
    shards: int  # weight shards written
    total_bytes: int  # bytes of the output folder
    warnings: list[str] = field(default_factory=list)



APPLY_EDIT_KEYS = ("behavior", "spec_hash", "spec_version", "behavior_spec_sha256", "method", "strength")
"""Patch metadata an applied variant's manifest repeats under ``edit``: what the card and ``publish`` read
(``spec_hash`` is what ``blaze edit`` records; ``behavior_spec_sha256`` is an older patches' name)."""

def patch_problems(patch: PatchArrays) -> list[str]:
    """What is wrong with the patch itself: non-finite factors, tensors its base identity does not list."""
    problems = []
    for name in patch.names():
        u, v = patch.factors[name]
        for label, factor in (("U", u), ("V", v)):
            if not np.isfinite(factor).all():
                problems.append(f"its factor {name}.{label} holds NaN or infinite values")
    recorded = patch.base_identity or {}
    listed = recorded.get("tensor_sha256") or {}
    if recorded:  # an identity that lists no tensor hashes checks none of the edited tensors: refused too
        unlisted = [name for name in patch.names() if name not in listed]
        if unlisted:
            problems.append(f"it edits {len(unlisted)} tensor(s) its base identity does not list "
                            f"(first: {unlisted[0]}.weight), so their base values cannot be checked")
    return problems


def apply_patch(patch: Path, out: Path, *, base: str | None = None, revision: str | None = None,
                force: bool = False, max_shard_bytes: int = 5 * 10**9,
                warn: Callable[[str], None] = lambda _m: None, also_writes: Sequence[Path] = ()) -> ApplyResult:
    """Apply the patch file at `patch` (or a variant folder holding one) to its base; write the variant to `out`.

    `base`/`revision` default to what the patch records (else Cloudflare/clef-flash). `force` replaces an
    earlier blaze output at `out` and applies even to a different base (with warnings through `warn`).
    Raises BlazeError (bad patch, wrong base, unwritable output); nothing is left at `out` on failure.
    `also_writes` are further output folders the caller writes afterwards (``--export-lora``): each is checked
    as `out` is, and against the base and `out`, before anything is written.
    """
    check_output_folders(out, also_writes, force)
    patch_file = patch_path(patch)
    loaded = PatchArrays.load(patch_file)
    problems = patch_problems(loaded)
    if problems:
        raise BlazeError(f"the patch {patch_file} is damaged or unsafe: {'; '.join(problems[:3])}. "
                         "Re-create it (blaze edit) or re-download it; the base was not the problem.")
    recorded = loaded.base_identity or {}
    ref = base or recorded.get("ref") or DEFAULT_BASE
    release = resolve_release(ref, revision if revision is not None else (None if base else recorded.get("revision")))
    check_apart_from_base((out, *also_writes), Path(release.path))
    warnings: list[str] = []

    def warning(message: str) -> None:
        warnings.append(message)
        warn(message)

    expected: dict[str, str] = {}
    trusted: dict[str, str] = {}
    if not recorded:
        warning(f"the patch records no base identity; it cannot be checked against {release.ref}. Applying anyway.")
    else:
        # the index now; the edited tensors' hashes as they stream by (read once, not twice)
        mismatches, _ = check_identity(loaded, release, tensors=False)
        if mismatches and not force:
            raise BlazeError(f"{release.ref} is not the base this patch was made from ({'; '.join(mismatches[:3])}). "
                             "Pass the right --base, or --force to apply anyway.")
        if mismatches:
            warning(f"applying to a different base than recorded ({'; '.join(mismatches[:3])}).")
        # tensors in a shard whose known hash equals the recorded one need no hashing at all
        trusted = {} if mismatches else trusted_tensor_sha256(loaded, release)
        if not force:
            expected = {n: d for n, d in recorded.get("tensor_sha256", {}).items() if n not in trusted}
    extra = {"command": "apply", "patch_sha256": sha256_file(patch_file), **{
        k: v for k, v in loaded.metadata.items() if k in APPLY_EDIT_KEYS}}
    try:
        write_variant(release, loaded, out, force=force, max_shard_bytes=max_shard_bytes, manifest_extra=extra,
                      known_tensor_sha256=trusted, expect_tensor_sha256=expected)
    except BaseMismatchError as error:
        raise BlazeError(f"{release.ref} is not the base this patch was made from ({error}). "
                         "Pass the right --base, or --force to apply anyway.") from error
    manifest = read_manifest(out)
    if force and recorded:
        found = manifest.base.tensor_sha256
        differ = [n for n, digest in recorded.get("tensor_sha256", {}).items() if n in found and found[n] != digest]
        if differ:
            warning(f"applied to a different base than recorded ({len(differ)} edited tensors have different "
                    f"values, e.g. {differ[0]}.weight).")
    matrices = manifest.matrices
    changes = [m.relative_change for m in matrices.values()
               if m.relative_change is not None and math.isfinite(m.relative_change)]
    return ApplyResult(
        out=Path(out), release=release, patch=loaded, patch_file=patch_file, matrices=len(matrices),
        ranks=sorted({m.numerical_rank for m in matrices.values() if m.numerical_rank is not None}),
        max_relative_change=max(changes, default=0.0),
        shards=sum(1 for name in manifest.output.files
                   if name.endswith(".safetensors") and name.startswith("model")),
        total_bytes=sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file()),
        warnings=warnings,
    )
