"""`blaze edit`: behaviour spec → statistics (once, cached) → strength search → variant folder + canary.

The stages, each with progress on stderr:

1. load the spec and the base runtime (once);
2. collect statistics over the spec's training pairs and the preserve set (cached on disk, reused
   by every strength point and by later builds with the same inputs);
3. with ``strength="auto"``: for each point of the spec's strength grid, solve (seconds), apply the
   patch in memory and run the canary on the spec's *validation* split against the unedited model;
   keep the strongest point whose gate passes (the held-out prompts are never looked at here);
4. run the full canary (held-out + general suites) on the chosen edit, unless disabled;
5. stream the variant folder (:func:`surgery.write.write_variant`) with the canary report inside,
   optionally export a LoRA adapter, and print a summary.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from clef_model.errors import BlazeError
from clef_model.files import CANARY_JSON, CANARY_MD

DATA_DIR = Path(__file__).parent / "data"


@dataclass
class BuildOptions:
    """Every option of ``blaze edit``; ``None`` means "the behaviour spec's default"."""

    behavior: str
    out: Path
    base: str | None = None
    revision: str | None = None
    method: str | None = None
    rank: int | None = None
    strength: float | str | None = None
    layers: str | None = None
    kinds: str | None = None
    lam: float | None = None
    threshold: float | None = None
    device: str | None = None
    dtype: str | None = None
    force: bool = False
    canary: bool = True
    export_lora: Path | None = None
    trust_release_code: bool = False
    batch_size: int = 8
    max_new_tokens: int | None = None
    cache_dir: Path | None = None
    progress: bool = True


@dataclass
class BuildResult:
    """What a build produced."""

    out: Path | None
    patch: Any
    strength: float
    sweep: list[dict] = field(default_factory=list)
    canary: dict | None = None
    summary: str = ""


# ------------------------------------------------------------------------------------------ inputs
def load_preserve_chat() -> list:
    """The neutral chat prompts shipped in ``variants/data/preserve_chat.json`` (empty when absent).

    Accepts a JSON list of prompts or an object with a ``prompts`` list; items may be prompts or
    ``{"prompt": ...}`` objects.
    """
    path = DATA_DIR / "preserve_chat.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    items = data.get("prompts", []) if isinstance(data, dict) else data
    return [item["prompt"] if isinstance(item, dict) else item for item in items]


def contrast_pairs(spec) -> list:
    """The spec's training pairs as ``ContrastPair``s, tagged with their direction index."""
    from surgery.directions import ContrastPair

    out = []
    for index, (_name, pairs) in enumerate(spec.contrast_pairs_by_direction().items()):
        out.extend(ContrastPair(**pair, direction=index) for pair in pairs)
    return out


def read_positions(pairs) -> str:
    """Where directions are read. When every pair contrasts two different system prompts:
    ``shared_response`` — each of the pair's responses under both system prompts, read at the response
    positions, so the contrast is the "mode" alone and the keys are answer-writing positions (on SmolLM2
    verbosity: a 64% held-out cut at strength 0.4, against 33% for the ``prompt_end`` reading, whose keys
    are the last prompt token only). Otherwise the response positions of the two different answers."""
    if pairs and all(p.wanted_system and p.unwanted_system and p.wanted_system != p.unwanted_system for p in pairs):
        return "shared_response"
    return "response"


def preserve_set(spec, runtime):
    """Default preserve set: the canary decision suite (Clef releases only; requests with images are
    left out because statistics run the text model alone) + preserve_chat.json + the spec's preserve."""
    from surgery.statistics import PreserveSet

    requests: list[dict] = []
    if getattr(runtime, "is_clef", False):
        from canaries.suites import default_decision_suite, request_bodies

        requests = [r for r in request_bodies(default_decision_suite()) if not r.get("images")]
    return PreserveSet(texts=load_preserve_chat() + list(spec.preserve_prompts()), requests=requests)


def _settings(spec, opts: BuildOptions) -> dict[str, Any]:
    d = spec.defaults
    pick = lambda value, default: default if value is None else value  # noqa: E731
    strength = pick(opts.strength, d.strength)
    if isinstance(strength, str) and strength != "auto":
        try:
            strength = float(strength)
        except ValueError:
            raise BlazeError(f"--strength must be a number or 'auto' (got {strength!r})") from None
    return {
        "method": pick(opts.method, d.method),
        "rank": int(pick(opts.rank, d.rank)),
        "strength": strength,
        "grid": sorted(float(s) for s in d.strength_grid),
        "layers": pick(opts.layers, d.layers),
        "kinds": pick(opts.kinds, ",".join(d.kinds)),
        "lam": float(pick(opts.lam, d.lam)),
        "threshold": float(pick(opts.threshold, d.threshold)),
        "max_new_tokens": int(pick(opts.max_new_tokens, d.max_new_tokens)),
    }


def _cache_file(opts: BuildOptions, runtime, spec, s: dict) -> Path:
    from clef_model.env import cache_root

    root = opts.cache_dir or cache_root() / "statistics"
    key = json.dumps([str(runtime.release.path), getattr(runtime.release, "revision", None), spec.spec_hash,
                      s["layers"], s["kinds"], s["rank"], str(runtime.dtype), str(runtime.device)]
                     + ([s["positions"]] if s.get("positions", "response") != "response" else []))
    return Path(root) / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


# ------------------------------------------------------------------------------------------ sweep
_DAMAGE_CHECKS = {"first_token_kl", "mean_token_kl", "loops", "limit", "empty", "decision_drift", "argmax_flips",
                  "quality"}


def sweep_row(strength: float, report: dict) -> dict:
    """One line of the sweep table from a canary report."""
    gate = report["gate"]
    values = {c["name"]: c["value"] for c in gate["checks"]}
    return {"strength": strength, "passed": gate["passed"], "failed": gate["failed"], **values}


def sweep_strength(runtime, stats, spec, s: dict, *, solve_patch: Callable[[float], Any],
                   echo: Callable[[str], None], progress: bool = True, batch_size: int = 8) -> tuple[float, list]:
    """Try each strength of the grid (ascending) on the validation split; return the strongest that
    passes the gate, and the table. Stops early once a point fails a damage check after a pass:
    stronger edits only degrade further."""
    from canaries.cache import MemoryCache
    from canaries.handles import ModelView
    from canaries.run import freeform_suite, run_canary

    items = spec.validation_items()
    if not items:
        raise BlazeError(f"behaviour {spec.name!r} has no validation items: --strength auto needs them "
                         "(or pass --strength NUMBER)")
    prompts = freeform_suite(items, general=False)
    cache = MemoryCache()
    base = ModelView(runtime, label="base")
    rows: list[dict] = []
    best: float | None = None
    for strength in s["grid"]:
        patch = solve_patch(strength)
        view = ModelView(runtime, activate=lambda p=patch: p.applied(runtime), label=f"strength {strength:g}")
        report = run_canary(view, base, freeform_prompts=prompts, thresholds=spec.gate.to_dict(),
                            quality=spec.quality, max_new_tokens=s["max_new_tokens"], progress=progress,
                            batch_size=batch_size, base_cache=cache, base_key="sweep-base")
        row = sweep_row(strength, report)
        rows.append(row)
        echo(_row_text(row))
        if row["passed"]:
            best = strength
        elif best is not None and set(row["failed"]) & _DAMAGE_CHECKS:
            break
    if best is None:
        raise BlazeError(
            "no strength in the grid passed the gate on the validation prompts:\n" + format_sweep(rows)
            + "\nTry other --layers/--kinds/--method, a wider grid, or a fixed --strength with --no-canary."
        )
    return best, rows


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _row_text(row: dict) -> str:
    keys = [k for k in row if k not in ("strength", "passed", "failed")]
    parts = " ".join(f"{k}={_fmt(row[k])}" for k in keys)
    return f"strength {row['strength']:<6g} {'PASS' if row['passed'] else 'fail'}  {parts}"


def format_sweep(rows: list[dict]) -> str:
    """The sweep table as text."""
    return "\n".join(_row_text(r) for r in rows)


# ------------------------------------------------------------------------------------------ build
def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def build_variant(opts: BuildOptions, echo: Callable[[str], None] = print) -> BuildResult:
    """Run a whole ``blaze edit``; see the module docstring."""
    from clef_model.release import DEFAULT_BASE
    from clef_model.runtime import Runtime
    from surgery.edit import collect_statistics, format_targets, solve, weights_from_runtime
    from surgery.patch import base_identity
    from variants.spec import load_behavior

    started = time.perf_counter()
    out = Path(opts.out)
    from clef_model.outputs import check_output

    check_output(out, opts.force)  # before minutes of compute: not empty, blaze's own (--force), writable
    spec = load_behavior(opts.behavior)
    s = _settings(spec, opts)
    echo(f"behaviour {spec.name} v{spec.version}: {spec.description}")
    import torch

    dtype = getattr(torch, opts.dtype) if opts.dtype else None
    runtime = Runtime.load(opts.base or DEFAULT_BASE, revision=opts.revision, device=opts.device, dtype=dtype,
                           trust_release_code=opts.trust_release_code)
    echo(f"base {runtime.release.ref} ({runtime.release.architecture}, {len(runtime.decoder_layers())} layers) "
         f"on {runtime.device}")
    pairs = contrast_pairs(spec)
    keep = preserve_set(spec, runtime)
    echo(f"data: {len(pairs)} contrast pairs, preserve {len(keep.texts)} chat prompts + "
         f"{len(keep.requests)} typed-decision requests")
    s["positions"] = read_positions(pairs)
    echo(f"directions read at: {s['positions']}")
    stats = collect_statistics(runtime, pairs, keep, s["layers"], s["kinds"], rank=s["rank"],
                               batch_size=opts.batch_size, cache=_cache_file(opts, runtime, spec, s),
                               progress=opts.progress, echo=echo, positions=s["positions"])
    weights = weights_from_runtime(runtime)
    targets = list(stats.keys)
    identity = base_identity(runtime.release, targets)
    common = {"behavior": spec.name, "spec_hash": spec.spec_hash, "spec_version": spec.version}

    def solve_patch(strength: float, extra: dict | None = None):
        return solve(stats, s["method"], strength, s["rank"], s["lam"], s["threshold"], weights=weights,
                     base_identity=identity, metadata={**common, **(extra or {})}, device=runtime.device)

    sweep: list[dict] = []
    if s["strength"] == "auto":
        echo(f"strength auto: grid {s['grid']} on {len(spec.validation_items())} validation prompts")
        strength, sweep = sweep_strength(runtime, stats, spec, s, solve_patch=solve_patch, echo=echo,
                                         progress=opts.progress, batch_size=opts.batch_size)
        echo(f"chose strength {strength:g} (strongest passing point)")
    else:
        strength = float(s["strength"])
    choice = {"strength": strength, "strength_mode": "auto" if sweep else "fixed", "sweep": sweep}
    patch = solve_patch(strength, choice)

    report = None
    extra_files: Any = None
    if opts.canary:
        from canaries.handles import ModelView
        from canaries.run import freeform_suite, run_canary, to_markdown

        report = run_canary(ModelView(runtime, activate=lambda: patch.applied(runtime), label="variant"),
                            ModelView(runtime, label="base"),
                            freeform_prompts=freeform_suite(spec.heldout_items(), general=True),
                            thresholds=spec.gate.to_dict(), quality=spec.quality,
                            max_new_tokens=s["max_new_tokens"], progress=opts.progress, batch_size=opts.batch_size,
                            prompted_system=spec.wanted_system_prompt())  # the prompted ceiling: final canary only
        def extra_files(folder: Path) -> dict[str, bytes]:
            """Integrity of the written (not yet renamed) folder against the base, then the final gate."""
            from canaries.gate import evaluate
            from canaries.integrity import check_integrity

            report["integrity"] = check_integrity(folder, runtime.release, device=runtime.device)
            report["gate"] = evaluate(report, spec.gate.to_dict())
            manifest_extra["canary_gate"] = {"passed": report["gate"]["passed"], "failed": report["gate"]["failed"]}
            echo(f"canary (held-out + general + integrity): gate "
                 f"{'PASSED' if report['gate']['passed'] else 'FAILED'}"
                 + ("" if report["gate"]["passed"] else f" ({', '.join(report['gate']['failed'])})"))
            return {CANARY_JSON: json.dumps(report, indent=2, default=str).encode(),
                    CANARY_MD: to_markdown(report).encode()}
    manifest_extra = {
        **common, **choice, "method": s["method"], "rank": s["rank"], "lambda": s["lam"],
        "threshold": s["threshold"], "layers": stats.meta.get("layers"), "kinds": stats.meta.get("kinds"),
        "positions": s["positions"],
        "layers_spec": s["layers"], "statistics": {k: v for k, v in stats.meta.items() if k != "shapes"},
        "canary_gate": None if report is None else {"passed": report["gate"]["passed"],
                                                    "failed": report["gate"]["failed"]},
    }
    from surgery.write import write_variant

    written = write_variant(runtime.release, patch, out, force=opts.force, manifest_extra=manifest_extra,
                            progress=opts.progress, extra_files=extra_files)
    if opts.export_lora:
        from surgery.lora import export_lora

        export_lora(patch, runtime.release, Path(opts.export_lora), force=opts.force)
        echo(f"LoRA adapter: {opts.export_lora}")
    seconds = time.perf_counter() - started
    rels = [i.get("rel_change") for i in patch.metadata["targets"].values() if i.get("rel_change") is not None]
    summary = "\n".join([
        format_targets(patch.metadata["targets"]),
        f"edited {len(patch.names())} matrices, rank ≤ {s['rank']}, method {s['method']}, "
        f"strength {strength:g} ({choice['strength_mode']}), λ {s['lam']:g}",
        f"relative change ‖ΔW‖/‖W‖: max {max(rels, default=0):.2e}, mean {sum(rels) / max(len(rels), 1):.2e}",
        f"wrote {written} ({_folder_bytes(written) / 1e6:.1f} MB) in {seconds:.0f} s",
    ])
    echo(summary)
    return BuildResult(out=written, patch=patch, strength=strength, sweep=sweep, canary=report, summary=summary)
