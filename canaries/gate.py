"""The pass/fail gate: thresholds on effect size, damage, degeneration, decision drift, quality and integrity.

Threshold names and meanings are those of a behaviour spec's `gate` section (docs/BEHAVIORS.md); defaults here
apply when no behaviour is named. Degeneration rates are *new* cases: prompts where the variant loops / runs to
the token limit / answers empty while the base did not. First-token KL is the mean over the neutral prompts.
"""

from __future__ import annotations

from typing import Any

from clef_model.errors import BlazeError

DEFAULT_THRESHOLDS: dict[str, Any] = {
    "effect": "none",             # "length_cut" | "quality_gain" | "none"
    "min_effect": 0.0,
    "max_first_token_kl": 0.1,
    "max_mean_token_kl": 0.2,
    "max_loop_rate": 0.0,
    "max_limit_rate": 0.1,
    "max_empty_rate": 0.0,
    "max_decision_drift": 0.05,
    "max_argmax_flips": 0,
    "min_quality_ratio": 0.95,
}
EFFECTS = ("length_cut", "quality_gain", "none")


def resolve_thresholds(*layers: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults, then each layer in turn (behaviour spec `gate`, then command-line overrides); None values skip."""
    thresholds = dict(DEFAULT_THRESHOLDS)
    for layer in layers:
        for key, value in (layer or {}).items():
            if key not in DEFAULT_THRESHOLDS:
                raise BlazeError(f"unknown gate threshold {key!r}; known: {', '.join(sorted(DEFAULT_THRESHOLDS))}")
            if value is not None:
                thresholds[key] = value
    if thresholds["effect"] not in EFFECTS:
        raise BlazeError(f"gate effect must be one of {', '.join(EFFECTS)}, got {thresholds['effect']!r}")
    return thresholds


def _check(name: str, value: Any, op: str, threshold: Any, detail: str) -> dict[str, Any]:
    passed = value <= threshold if op == "<=" else value >= threshold if op == ">=" else value == threshold
    return {"name": name, "value": value, "op": op, "threshold": threshold, "passed": bool(passed), "detail": detail}


def evaluate(report: dict[str, Any], thresholds: dict[str, Any]) -> dict[str, Any]:
    """Gate checks over a report's sections; `passed` is True when every check passed."""
    t = resolve_thresholds(thresholds)
    checks = []
    free = report["freeform"]["summary"]
    if t["effect"] == "length_cut":
        checks.append(_check("effect", free["length_cut"], ">=", t["min_effect"],
                             "relative cut of mean answer length (tokens) on the behaviour prompts"))
    elif t["effect"] == "quality_gain":
        checks.append(_check("effect", free["quality"]["gain"], ">=", t["min_effect"],
                             "share of behaviour prompts gaining a keyword hit"))
    damage = report["damage"]["summary"]
    checks.append(_check("first_token_kl", damage["first_token_kl"]["mean"], "<=", t["max_first_token_kl"],
                         "mean KL(base‖variant) of the first token on neutral prompts"))
    checks.append(_check("mean_token_kl", damage["mean_token_kl"], "<=", t["max_mean_token_kl"],
                         "mean per-token KL over the base's greedy continuation"))
    checks.append(_check("loops", free["loop_rate"]["new"], "<=", t["max_loop_rate"],
                         "share of prompts where only the variant loops"))
    checks.append(_check("limit", free["hit_limit_rate"]["new"], "<=", t["max_limit_rate"],
                         "share of prompts where only the variant runs to the token limit"))
    checks.append(_check("empty", free["empty_rate"]["new"], "<=", t["max_empty_rate"],
                         "share of prompts where only the variant answers empty"))
    decisions = report["decisions"]
    if decisions.get("applicable"):
        checks.append(_check("decision_drift", decisions["summary"]["max_abs_delta"], "<=", t["max_decision_drift"],
                             "largest |Δp| over every option of the typed-decision suite"))
        checks.append(_check("argmax_flips", decisions["summary"]["argmax_flips"], "<=", t["max_argmax_flips"],
                             "questions whose chosen option changed"))
    quality = free["quality"]
    if quality["gated"] and quality["ratio"] is not None:
        checks.append(_check("quality", quality["ratio"], ">=", t["min_quality_ratio"],
                             f"variant keyword hits / base hits ({quality['check']})"))
    integrity = report.get("integrity")
    if integrity:
        checks.append(_check("integrity", bool(integrity["passed"]), "==", True,
                             "joint head and release code identical, only expected tensors changed"))
    return {"passed": all(c["passed"] for c in checks), "thresholds": t, "checks": checks,
            "failed": [c["name"] for c in checks if not c["passed"]]}
