"""Preservation on the trained decision fixture (issue 13): verbosity edits with λ = 0, the default λ, a larger λ
and nullspace, measured on the canary decision suite and the held-out labelled eval set.

    python scripts/decision_preservation.py RELEASE WORKDIR [--strength 0.3] [--lambdas 0,1,100] [--null-threshold 0.1] [--auto]
        [--preserve-requests FILE.jsonl ...]

RELEASE is a `blaze fixture --preset decisions` folder. Each edit runs through the CLI (`blaze edit … --no-canary`,
statistics cached between runs, so only the first collects them; `--preserve-requests FILE` is passed to
every edit, e.g. RELEASE/decision_dev.jsonl, the user's own decision traffic); the measurements run here:

- suite: max |Δp| and flips over the default decision suite (`canaries/suites/decisions.jsonl`, image included);
- eval: max |Δp|, flips and accuracy over RELEASE/decision_eval.jsonl;
- effect: the behaviour effect at the edited layers as `tests/test_preservation.py` measures it: the mean shift
  of each edited layer's output along its behaviour direction (read from 16 training pairs on the base), over
  the response positions of 6 other pairs, averaged over layers.

Prints a Markdown table and writes WORKDIR/preservation.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch


def _edit(release: Path, out: Path, strength: str, extra: list[str]) -> float:
    command = [sys.executable, "-m", "variants.cli", "edit", "--base", str(release), "--behavior", "verbosity",
               "--strength", strength, "--no-canary", "--device", "cpu", "--out", str(out), "--force", *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def _drift(a: list[dict], b: list[dict]) -> tuple[float, int]:
    deltas, flips = [0.0], 0
    for pa, pb in zip(a, b, strict=True):
        for qid in pa:
            deltas += [abs(pa[qid][o] - pb[qid][o]) for o in pa[qid]]
            flips += max(pa[qid], key=pa[qid].get) != max(pb[qid], key=pb[qid].get)
    return max(deltas), flips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", type=Path)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--strength", default="0.3")
    parser.add_argument("--lambdas", default="0,1,100", help="λ values for steer (the spec's default is 1)")
    parser.add_argument("--null-threshold", default=None,
                        help="nullspace --threshold (the spec's 0.01 is refused on the tiny fixture: every direction)")
    parser.add_argument("--auto", action="store_true", help="also run each setting at --strength auto")
    parser.add_argument("--preserve-requests", action="append", default=[], type=Path, metavar="FILE",
                        help="passed to every edit (`blaze edit --preserve-requests FILE`); repeatable")
    args = parser.parse_args()
    preserve = [arg for path in args.preserve_requests for arg in ("--preserve-requests", str(path))]
    torch.set_num_threads(1)

    from canaries import decision_eval as de
    from canaries.suites import default_decision_suite, request_bodies
    from clef_model.runtime import Runtime
    from surgery.directions import layer_directions
    from surgery.edit import collect_statistics
    from surgery.statistics import contrast_sequences
    from variants.build import contrast_pairs
    from variants.spec import load_behavior

    settings = [(f"steer λ={lam}", ["--lambda", lam]) for lam in args.lambdas.split(",")]
    null = ["--threshold", args.null_threshold] if args.null_threshold else []
    settings.append((f"nullspace (threshold {args.null_threshold or 'spec'})", ["--method", "nullspace", *null]))
    strengths = [args.strength] + (["auto"] if args.auto else [])
    args.workdir.mkdir(parents=True, exist_ok=True)

    records = de.load_eval_file(args.release / "decision_eval.jsonl")
    suite = request_bodies(default_decision_suite())
    base = Runtime.load(str(args.release), device="cpu", dtype=torch.float32)
    base_suite = base.decision_probabilities(suite)
    base_eval = de.probabilities(base, records, 16)
    base_metrics = de.metrics(records, base_eval)
    floor = de.noise_floor(base, records, base_eval, 16)
    pairs = contrast_pairs(load_behavior("verbosity"))
    train, measure = pairs[:16], pairs[100:106]

    rows = []
    for strength in strengths:
        for label, extra in settings:
            out = args.workdir / re.sub(r"[^a-z0-9]+", "-", f"{label}-{strength}".lower()).strip("-")
            seconds = _edit(args.release, out, strength, [*extra, *preserve])
            manifest = json.loads((out / "blaze_manifest.json").read_text())
            variant = Runtime.load(str(out), device="cpu", dtype=torch.float32)
            changed = sorted({int(m.group(1)) for name in variant.release.weight_map()
                              for m in [re.search(r"layers\.(\d+)\.", name)] if m}
                             & set(_edited_layers(out)))
            suite_drift, suite_flips = _drift(base_suite, variant.decision_probabilities(suite))
            variant_eval = de.probabilities(variant, records, 16)
            eval_drift, eval_flips = _drift(base_eval, variant_eval)
            effect = _effect(base, variant, changed, train, measure, collect_statistics, layer_directions,
                             contrast_sequences)
            chosen = _chosen_strength(manifest, strength)
            rows.append({"setting": label, "strength": strength, "chosen_strength": chosen, "layers": changed,
                         "suite_max_abs_delta": suite_drift, "suite_flips": suite_flips,
                         "eval_max_abs_delta": eval_drift, "eval_flips": eval_flips,
                         "eval_accuracy": de.metrics(records, variant_eval).accuracy, "effect": effect,
                         "edit_seconds": round(seconds, 1)})
            print(json.dumps(rows[-1]), flush=True)
            del variant
    result = {"release": str(args.release), "preserve_requests": [str(p) for p in args.preserve_requests],
              "base_eval_accuracy": base_metrics.accuracy,
              "base_mean_confidence": base_metrics.mean_confidence, "noise_floor": floor.__dict__, "rows": rows}
    (args.workdir / "preservation.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nbase eval accuracy {base_metrics.accuracy:.4f}, mean confidence {base_metrics.mean_confidence:.4f}; "
          f"noise floor ({floor.path}) max |Δp| {floor.max_abs_delta:.4f}, flips {floor.flips}\n")
    print("| setting | strength | suite max abs Δp | suite flips | eval max abs Δp | eval flips | eval accuracy | "
          "effect at edited layers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['chosen_strength']} | {r['suite_max_abs_delta']:.4f} | {r['suite_flips']} | "
              f"{r['eval_max_abs_delta']:.4f} | {r['eval_flips']} | {r['eval_accuracy']:.4f} | {r['effect']:.4f} |")


def _edited_layers(folder: Path) -> list[int]:
    from safetensors import safe_open

    with safe_open(str(folder / "blaze_delta.safetensors"), "pt") as handle:
        names = list(handle.keys())
    return sorted({int(m.group(1)) for n in names for m in [re.search(r"layers\.(\d+)\.", n)] if m})


def _chosen_strength(manifest: dict, requested: str) -> str:
    text = json.dumps(manifest)
    found = re.search(r'"strength": ([0-9.]+)', text)
    return f"{requested} → {found.group(1)}" if requested == "auto" and found else requested


def _effect(base, variant, layers, train, measure, collect_statistics, layer_directions, contrast_sequences) -> float:
    """Mean shift of the edited layers' outputs along the behaviour direction (tests/test_preservation.py)."""
    if not layers:
        return 0.0
    spec = ",".join(str(layer) for layer in layers)
    stats = collect_statistics(base, train, None, spec, "writers", progress=False, positions="shared_response")
    directions = layer_directions(stats.wanted_means, stats.unwanted_means, 1)
    seqs = contrast_sequences(base, measure, positions="shared_response")

    def residuals(rt) -> dict[int, list[torch.Tensor]]:
        out: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        hooks = [rt.decoder_layers()[layer].register_forward_hook(
            lambda _m, _i, o, layer=layer: out[layer].append((o[0] if isinstance(o, tuple) else o)[0].double()))
            for layer in layers]
        try:
            with torch.no_grad():
                for s in seqs:
                    rt.text_model()(input_ids=torch.tensor([s.ids]))
        finally:
            for hook in hooks:
                hook.remove()
        return out

    edited, original = residuals(variant), residuals(base)
    shifts = []
    for layer in layers:
        r = directions[layer].basis[:, 0]
        shift = torch.cat([(a - b)[s.positions] for a, b, s in zip(edited[layer], original[layer], seqs, strict=False)]) @ r
        shifts.append(shift.mean().item())
    return sum(shifts) / len(shifts)


if __name__ == "__main__":
    main()
