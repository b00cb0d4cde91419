"""`blaze edit`: make a behaviour variant (statistics → closed-form solve → strength search → variant + canary).

The edit settings' options are generated from ``variants.spec.EditSettings`` and the gate's from
``canaries.gate.Thresholds`` (``variants.cli.options``): one definition, with its help text, per setting.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from canaries.gate import Thresholds
from variants.cli.options import dataclass_options, field_names
from variants.spec import EditSettings

EDIT_SKIP = ("strength_grid",)


@click.command("edit")
@click.option("--behavior", "-b", required=True,
              help="Behaviour spec: a catalogue name (see `blaze behaviors`) or a path to a spec JSON file.")
@click.option("--out", "-o", required=True, type=click.Path(path_type=Path),
              help="Output folder for the variant (a drop-in release). Refused if not empty, unless --force.")
@click.option("--base", default=None,
              help="Base release: a folder, a Hub id, or `smollm2` (the embedded SmolLM2-135M-Instruct). "
                   "Default: Cloudflare/clef-flash.")
@click.option("--revision", default=None, help="Hub revision of the base (branch, tag or commit).")
@dataclass_options(EditSettings, default_note="Default: the spec's.", skip=EDIT_SKIP)
@dataclass_options(Thresholds, default_note="Default: the spec's gate.")
@click.option("--device", default=None, help="cuda, cpu, cuda:1, … Default: cuda when available.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Compute dtype. Default: float32 on the CPU, and on CUDA for a plain chat model of ≤ 4 GB of "
                   "weights (bfloat16 answers there move with the batch alone, at the size of the search's "
                   "verdicts); bfloat16 for Clef and larger models. The variant keeps the base's stored dtype.")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="Prompts per generation batch (search passes, canaries). Default: 128 on the CPU (a decode "
                   "step there reads every weight whatever the rows: 64 rows take about 3x the time of 8), 16 on a "
                   "GPU. Statistics run at most 8 "
                   "sequences per forward.")
@click.option("--force", is_flag=True, help="Overwrite a non-empty --out folder.")
@click.option("--no-canary", is_flag=True, help="Skip the final canary (held-out + general suites).")
@click.option("--export-lora", type=click.Path(path_type=Path), default=None,
              help="Also write a PEFT LoRA adapter equal to the edit into this folder.")
@click.option("--trust-release-code", is_flag=True,
              help="Run a base's release code even if its SHA-256 is not on blaze's allowlist.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Where activation statistics are cached (default: $BLAZE_CACHE or ~/.cache/blaze).")
@click.option("--preserve-requests", "preserve_requests", multiple=True, type=click.Path(path_type=Path),
              metavar="FILE.jsonl",
              help="Your own decision traffic to preserve (Clef releases; repeatable): SystemOne requests, one JSON "
                   "object a line, in the decision-eval record format (`labels` optional and ignored). Added to "
                   "the preserve set; requests with images are skipped (statistics run the text model only). "
                   "The files' SHA-256 go into the manifest.")
def edit(behavior: str, out: Path, base: str | None, revision: str | None, device: str | None, dtype: str | None,
         batch_size: int | None, force: bool, no_canary: bool, export_lora: Path | None, trust_release_code: bool,
         cache_dir: Path | None, preserve_requests: tuple[Path, ...], **settings: Any) -> None:
    """Make a behaviour variant of a base release by closed-form, rank-limited weight edits.

    \b
    Exit codes: 0 written and the final canary's gate passed (or `--no-canary`); 1 a gate verdict:
    `--strength auto` found no point that passes (nothing written), or the final canary on the held-out
    split failed (the variant is written with its report, and `blaze publish` refuses it); 2 bad input or refused.
    Example:
      blaze edit --behavior verbosity --out ./clef-flash-concise
      blaze edit --base smollm2 --behavior verbosity --out ./smollm2-concise --device cpu
      blaze edit --behavior verbosity --preserve-requests my_traffic.jsonl --out ./clef-flash-concise
    """
    from clef_model.env import quiet
    from variants.build import BuildOptions, build_variant
    from variants.search import NoPassingPoint

    gate = {name: settings.pop(name) for name in field_names(Thresholds)}
    try:
        result = build_variant(BuildOptions(
            behavior=behavior, out=out, base=base, revision=revision, **settings, gate=gate, device=device,
            dtype=dtype, force=force, canary=not no_canary, export_lora=export_lora,
            trust_release_code=trust_release_code, batch_size=batch_size, cache_dir=cache_dir,
            progress=not quiet(), preserve_requests=tuple(preserve_requests),
        ), echo=lambda message: click.echo(message, err=True))
    except NoPassingPoint as verdict:  # a gate verdict, not bad input: exit code 1
        click.echo(f"gate: {verdict}", err=True)
        sys.exit(1)
    gate_report = (result.canary or {}).get("gate") or {}
    if result.canary is not None and gate_report.get("passed") is not True:
        # The final canary (held-out + general + integrity) is a verdict too: the variant stays on disk with its
        # report for inspection, but the command says the gate failed, and `blaze publish` refuses it.
        failed = ", ".join(gate_report.get("failed") or []) or "see the report"
        click.echo(f"gate: the final canary FAILED ({failed}); the variant in {out} is kept for inspection, "
                   "and `blaze publish` will refuse it", err=True)
        sys.exit(1)
