"""`blaze apply`: re-apply a saved patch to a base by streaming — no GPU, no model run, no torch.

The command only parses options and prints; the work is `surgery.apply.apply_patch`.

Everything `apply` imports is torch-free (numpy + ml_dtypes: `surgery.delta`, `surgery.write`), which
keeps its peak memory far below the ≈ 700 MiB `import torch` costs; only `--export-lora` loads torch.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import click

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from a size such as `5GB`, `500MB`, `2GiB` or `123456` (decimal units, binary with `i`)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a number of bytes.")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise click.BadParameter("the shard size must be positive.")
    return value


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1000
    return f"{nbytes:.1f} TB"


@click.command("apply")
@click.argument("patch", type=click.Path(path_type=Path))
@click.option("--base", default=None,
              help="Base release the patch applies to: a folder, a Hub id, or `smollm2`. "
                   "Default: the base recorded in the patch, else Cloudflare/clef-flash.")
@click.option("--revision", default=None, help="Hub revision of the base (branch, tag or commit).")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path),
              help="Output folder for the variant. Refused if not empty, unless --force.")
@click.option("--force", is_flag=True,
              help="Overwrite a non-empty --out, and apply even when the base differs from the one recorded "
                   "in the patch.")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=lambda c, p, v: parse_size(v),
              help="Largest weight shard of the output (e.g. 5GB, 500MB, 2GiB).")
@click.option("--export-lora", type=click.Path(path_type=Path), default=None,
              help="Also write a PEFT LoRA adapter equal to the edit into this folder.")
def apply(patch: Path, base: str | None, revision: str | None, out: Path, force: bool,
          max_shard_size: int, export_lora: Path | None) -> None:
    """Apply PATCH (a blaze_delta.safetensors, or a variant folder holding one) to a base release.

    \b
    Streams the base checkpoint to OUT: untouched tensors are copied bit-identically, edited ones get
    W + U Vᵀ (fp32 math, cast back to the stored dtype); every other file is copied byte-for-byte and a
    manifest with SHA-256 hashes is written. The base is checked against the identity recorded in the
    patch (index hash and the edited tensors' hashes); a mismatch is refused unless --force. The
    edited tensors are verified as they stream by, so a mismatch there stops the write with nothing
    left behind.

    
    Input files whose SHA-256 is already known are not read again for the manifest: files of a
    Hugging Face cache snapshot (the blob name is the hash) and files in blaze's hash cache
    ($BLAZE_CACHE/sha256-cache.json, default ~/.cache/blaze; BLAZE_HASH_CACHE=0 turns it off).
    """
    # numpy's OpenBLAS otherwise starts a thread per core that busy-waits after each call (measured:
    # 1.4 % of apply's CPU samples); apply's few BLAS calls are small. Only effective before numpy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    from surgery.apply import apply_patch

    started = time.perf_counter()
    result = apply_patch(patch, out, base=base, revision=revision, force=force, max_shard_bytes=max_shard_size,
                         warn=lambda message: click.echo(f"warning: {message}", err=True),
                         also_writes=(export_lora,) if export_lora is not None else ())
    if export_lora is not None:
        from surgery.lora import export_lora as write_lora  # imports torch (PEFT); only for this option
        from surgery.patch import Patch

        write_lora(Patch.from_arrays(result.patch), result.release, export_lora, force=force)
    click.echo(f"wrote {out}: {result.matrices} matrices edited (rank {', '.join(map(str, result.ranks)) or '-'}, "
               f"‖ΔW‖/‖W‖ up to {result.max_relative_change:.4f}), {result.shards} shards, "
               f"{_human(result.total_bytes)}, {time.perf_counter() - started:.1f} s")
    if export_lora is not None:
        click.echo(f"wrote LoRA adapter {export_lora}")
