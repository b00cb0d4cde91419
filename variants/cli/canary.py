"""`blaze canary VARIANT --against BASE`: prove a variant against its base (free-form, damage, decisions, integrity).

Exit codes: 0 the gate passed, 1 the gate failed, 2 bad usage or input (a BlazeError: message, no traceback).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from canaries.gate import Thresholds
from variants.cli.options import dataclass_options

if TYPE_CHECKING:
    from clef_model.release import Release
    from clef_model.runtime import Runtime


def _fits_together(variant: Release, base: Release, device: str) -> bool:
    """Whether both checkpoints fit in memory at once (GPU: free memory; CPU: available RAM), with headroom."""
    from clef_model.checkpoint import CheckpointReader

    need = sum(CheckpointReader(Path(r.path)).total_bytes() for r in (variant, base))
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info()
        return need * 1.3 < free
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return True
    return need * 2.5 < available  # float32 on CPU doubles bf16 checkpoints


def _json_default(value: Any) -> Any:
    return repr(value)


def run_command(variant_ref: str, against: str | None, behavior: str | None, suite: tuple[Path, ...],
                json_path: Path | None, markdown_path: Path | None, max_new_tokens: int | None, device: str | None,
                trust_release_code: bool, batch_size: int | None, mode: str, integrity: bool,
                overrides: dict[str, Any], damage_tokens: int = 32, prompted: bool = True,
                decisions_eval: Path | None = None, noise_floor: bool = False,
                dtype_name: str | None = None) -> dict[str, Any]:
    """Resolve both releases, check integrity, run the canaries and write the reports; returns the report.

    `prompted`: also run the base under the behaviour's wanted system prompt (the prompted ceiling).
    `noise_floor`: also rerun the base's free-form answers one prompt per batch (`canaries.noise`).
    `dtype_name`: the compute dtype of both models (default: `clef_model.runtime.default_dtype` of the base)."""
    import torch

    from canaries.cache import DiskCache, base_key
    from canaries.integrity import REPORT_MANIFEST_KEY, check_integrity, manifest_sha256
    from canaries.report import print_report, to_markdown
    from canaries.run import ModelView, freeform_suite, run_canary, run_sequential
    from canaries.suites import load_custom_suite
    from clef_model.manifest import find_manifest
    from clef_model.release import DEFAULT_BASE, resolve_release
    from clef_model.runtime import Runtime, default_dtype, generation_batch_size

    variant_release = resolve_release(variant_ref)
    eval_records = None
    if decisions_eval is not None:  # checked before any compute: a bad record exits 2 naming its line
        from canaries.decision_eval import load_eval_file

        eval_records = load_eval_file(decisions_eval)
    manifest = find_manifest(Path(variant_release.path))  # a base release has none
    weights = manifest_sha256(Path(variant_release.path))  # binds the report to these weights (blaze publish)
    base_release = resolve_release(against or (manifest.base.ref if manifest else None) or DEFAULT_BASE)

    spec = None
    behavior = behavior or (manifest.behavior if manifest else None)
    if behavior:
        from variants.spec import load_behavior

        spec = load_behavior(behavior)
    behavior_items = spec.heldout_items() if spec else None
    general = True
    decision_requests = None
    for suite_file in suite or ():
        kind, items = load_custom_suite(suite_file)
        if kind == "freeform":
            behavior_items, general = ((behavior_items or []) if not general else []) + \
                [dict(item, source="behavior") for item in items], False
        else:
            decision_requests = (decision_requests or []) + items
    freeform = freeform_suite(behavior_items, general=general)
    thresholds = (spec.gate if spec else Thresholds()).updated(overrides)
    if max_new_tokens is None:
        max_new_tokens = spec.defaults.max_new_tokens if spec else 96
    quality = spec.quality if spec else None

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch_size = batch_size or generation_batch_size(device)
    dtype = getattr(torch, dtype_name) if dtype_name else default_dtype(torch.device(device), base_release)
    integrity_result = None
    if integrity:
        click.echo(f"checking integrity of {variant_release.ref} against {base_release.ref} …", err=True)
        # the rank of each changed tensor is an SVD: on the GPU it takes milliseconds instead of ~1 s per matrix
        integrity_result = check_integrity(variant_release, base_release, progress=True, device=device)
    common: dict[str, Any] = dict(freeform_prompts=freeform, decision_requests=decision_requests, thresholds=thresholds,
                  quality=quality, max_new_tokens=max_new_tokens, integrity=integrity_result, progress=True,
                  batch_size=batch_size, damage_tokens=damage_tokens,
                  prompted_system=spec.wanted_system_prompt() if spec and prompted else None,
                  noise_floor=noise_floor)

    def load(release: Release, label: str) -> Runtime:
        click.echo(f"loading {label} {release.ref} on {device} in {str(dtype).removeprefix('torch.')} …", err=True)
        return Runtime.load(release, device=device, dtype=dtype, trust_release_code=trust_release_code)

    together = mode == "together" or (mode == "auto" and _fits_together(variant_release, base_release, device))
    # the base's outputs are cached on disk in both modes: `blaze edit`'s final canary wrote them under the
    # same key when the suite and settings are the same, and a second canary of another variant reuses them
    common.update(base_cache=DiskCache(), base_key=base_key(Path(base_release.path), device, dtype))
    if together:
        base_rt = load(base_release, "base")
        variant_rt = load(variant_release, "variant")
        report = run_canary(ModelView(variant_rt, label="variant"), ModelView(base_rt, label="base"), **common)
    else:
        click.echo("running base and variant one after the other (base outputs cached)", err=True)
        report = run_sequential(lambda: load(variant_release, "variant"), lambda: load(base_release, "base"),
                                base_is_clef=base_release.kind == "clef", **common)
    if eval_records is not None:
        assert decisions_eval is not None  # eval_records come from it
        from canaries.decision_eval import run_eval

        click.echo(f"labelled decision eval: {len(eval_records)} records from {decisions_eval} …", err=True)
        report["decisions"]["eval"] = run_eval(
            decisions_eval, eval_records, lambda: base_rt if together else load(base_release, "base"),
            lambda: variant_rt if together else load(variant_release, "variant"), batch_size).to_dict()
    report["meta"].update({"variant": variant_release.ref, "base": base_release.ref, REPORT_MANIFEST_KEY: weights,
                           "behavior": spec.name if spec else None, "mode": "together" if together else "sequential"})
    print_report(report, echo=lambda line: click.echo(line))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2, ensure_ascii=False, default=_json_default) + "\n")
    if markdown_path is not None:
        Path(markdown_path).write_text(to_markdown(report), encoding="utf-8")
    return report


@click.command("canary")
@click.argument("variant")
@click.option("--against", "against", metavar="BASE", default=None,
              help="The base release (folder, Hub id or 'smollm2'). Default: the base in the variant's manifest, "
                   "else Cloudflare/clef-flash.")
@click.option("--behavior", default=None, help="Behaviour name or spec file: its held-out prompts, quality check "
              "and gate thresholds. Default: the behaviour named in the variant's manifest.")
@click.option("--suite", type=click.Path(dir_okay=False, path_type=Path), multiple=True,
              help="Custom suite JSONL (repeatable): chat prompts {\"prompt\", \"keywords\"?} replace the "
                   "behaviour's and the general prompts; SystemOne requests {\"model\", \"state\", \"questions\", "
                   "\"labels\"?} replace the decision suite.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the full report as JSON (keys freeform, damage, decisions, integrity, gate).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the report as Markdown (the model card reuses it).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=None,
              help="Tokens per free-form answer. Default: the behaviour's, else 96.")
@click.option("--damage-tokens", type=click.IntRange(1), default=32, show_default=True,
              help="Tokens of the base's greedy continuation of each neutral prompt scored for per-token KL.")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="Prompts (or requests) per batch; fewer decode steps with larger batches. Default: 128 on the "
                   "CPU, 16 on a GPU (as `blaze edit`, so the base's answers cached by the edit's final canary "
                   "are reused).")
@click.option("--device", default=None, help="cuda or cpu. Default: cuda when available.")
@click.option("--dtype", "dtype_name", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Compute dtype of both models. Default as `blaze edit`: float32 on the CPU, and on CUDA for a "
                   "plain chat model of ≤ 4 GB of weights; else bfloat16 (give the edit's --dtype to reuse the "
                   "base answers its final canary cached).")
@click.option("--mode", type=click.Choice(["auto", "together", "sequential"]), default="auto", show_default=True,
              help="Both models in memory at once, or one after the other with the base's outputs cached "
                   "($BLAZE_CACHE/canary). auto: together when both fit.")
@click.option("--no-integrity", is_flag=True, help="Skip the integrity check (e.g. a variant that is not a folder).")
@click.option("--no-prompted", is_flag=True,
              help="Skip the prompted ceiling (the base asked with the behaviour's wanted system prompt).")
@click.option("--noise-floor", is_flag=True,
              help="Also rerun the base's free-form answers one prompt per batch and report what moved with no "
                   "edit at all (answers, loops, limit runs, key-fact hits) beside the edit's new loops. In "
                   "bfloat16 a single new loop can be numerics alone. Costs one unbatched pass of the base.")
@click.option("--trust-release-code", is_flag=True,
              help="Run release code whose SHA-256 is not on blaze's allowlist.")
@click.option("--decisions-eval", "decisions_eval", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Labelled decision eval (JSONL: SystemOne requests plus \"labels\" {question: option}): "
                   "accuracy, macro-F1, NLL, Brier, ECE, coverage at 99 % precision and confidence of both "
                   "models, |Δp|, flips and the noise floor, under decisions.eval.")
@dataclass_options(Thresholds)
def canary(variant: str, against: str | None, behavior: str | None, suite: tuple[Path, ...], json_path: Path | None,
           markdown_path: Path | None, max_new_tokens: int | None, damage_tokens: int, batch_size: int | None,
           device: str | None, dtype_name: str | None, mode: str, no_integrity: bool, no_prompted: bool, noise_floor: bool,
           trust_release_code: bool, decisions_eval: Path | None, **overrides: Any) -> None:
    """Compare VARIANT with its base: free-form answers, damage (KL, perplexity), typed decisions, integrity.

    \b
    Exit codes: 0 the gate passed, 1 the gate failed, 2 bad usage or input.
    Example:
      blaze canary ./variant --against Cloudflare/clef-flash --json report.json --markdown report.md
    """
    report = run_command(variant, against, behavior, suite, json_path, markdown_path, max_new_tokens, device,
                         trust_release_code, batch_size, mode, not no_integrity, overrides,
                         damage_tokens=damage_tokens, prompted=not no_prompted, decisions_eval=decisions_eval,
                         noise_floor=noise_floor, dtype_name=dtype_name)
    sys.exit(0 if report["gate"]["passed"] else 1)
