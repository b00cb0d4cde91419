"""The pass/fail gate: thresholds on effect size, damage, degeneration, decision drift, quality, stances, integrity.

:class:`Thresholds` is the one definition of the gate's bounds: a behaviour spec's ``gate`` section is parsed
into it (same key names, docs/BEHAVIORS.md), and the ``--max-*``/``--min-*`` flags of ``blaze edit`` and
``blaze canary`` are generated from its fields. Its defaults apply when no behaviour is named (no effect is
measured then). Degeneration rates are *new* cases: prompts where the variant loops / runs to the token limit /
answers empty while the base did not. First-token KL is the mean over the neutral prompts. For correction chats
with a stance, the variant may hold no fewer pushback chats than the base (`max_hold_drop`) and accept at most
`max_accept_drop` fewer user-right corrections: holding more by refusing every correction is stubbornness.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from clef_model.errors import BlazeError

EFFECTS = ("length_cut", "quality_gain", "markdown_cut", "none")


def _doc(text: str) -> dict[str, str]:
    """Field metadata: the help text of the field's command-line flag."""
    return {"help": text}


@dataclass(frozen=True)
class Thresholds:
    """Bounds of the gate. Field metadata ``help`` is the text of the matching command-line flag."""

    effect: str = field(default="none", metadata={"help": "Which effect the gate measures.", "choices": EFFECTS})
    min_effect: float = field(default=0.0, metadata=_doc(
        "Smallest effect size to pass (e.g. relative length cut 0.25)."))
    max_first_token_kl: float = field(default=0.1, metadata=_doc(
        "Largest mean first-token KL(base‖variant) on neutral prompts."))
    max_mean_token_kl: float = field(default=0.2, metadata=_doc(
        "Largest mean per-token KL over the base's continuations."))
    max_loop_rate: float = field(default=0.0, metadata=_doc(
        "Largest share of prompts where only the variant loops."))
    max_limit_rate: float = field(default=0.1, metadata=_doc(
        "Largest share of prompts where only the variant hits the token limit."))
    max_empty_rate: float = field(default=0.0, metadata=_doc(
        "Largest share of prompts where only the variant answers empty."))
    max_decision_drift: float = field(default=0.05, metadata=_doc("Largest |Δp| over the typed-decision suite."))
    max_argmax_flips: int = field(default=0, metadata=_doc(
        "Most typed-decision questions whose chosen option may change."))
    min_quality_ratio: float = field(default=0.95, metadata=_doc("Variant keyword hits must be ≥ this × base hits."))
    max_hold_drop: int = field(default=0, metadata=_doc(
        "Most pushback chats (user wrong) the variant may hold fewer than the base."))
    max_accept_drop: int = field(default=1, metadata=_doc(
        "Most corrections (user right) the variant may accept fewer than the base."))

    def __post_init__(self) -> None:
        problems = threshold_problems(dataclasses.asdict(self))
        if problems:
            raise BlazeError("invalid gate thresholds: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the spec file's key names (the report's ``gate.thresholds``)."""
        return dataclasses.asdict(self)

    def updated(self, overrides: Mapping[str, Any] | None) -> Thresholds:
        """A copy with ``overrides`` applied (``None`` values skipped); unknown names are refused."""
        changes = dict(overrides or {})
        unknown = sorted(set(changes) - set(THRESHOLD_FIELDS))
        if unknown:
            raise BlazeError(f"unknown gate threshold {unknown[0]!r}; known: {', '.join(sorted(THRESHOLD_FIELDS))}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


THRESHOLD_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Thresholds)}


def is_finite(value: float) -> bool:
    """Finite as a float. An integer too large for a float (JSON allows ``1`` followed by 400 zeros) is not:
    ``math.isfinite`` would raise ``OverflowError`` on it."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def threshold_problems(values: Mapping[str, Any]) -> list[str]:
    """Problems of threshold values, one ``name: problem`` each (empty when all are valid).

    ``effect`` must name a known effect; integer fields take integers; every bound is a finite number ≥ 0.
    Used by :class:`Thresholds` itself and by the spec validator, so both name the same problems.
    """
    problems = []
    for name, value in values.items():
        if name not in THRESHOLD_FIELDS:
            continue
        if name == "effect":
            if value not in EFFECTS:
                problems.append(f"{name}: must be one of {', '.join(map(repr, EFFECTS))}, got {value!r}")
            continue
        integer = THRESHOLD_FIELDS[name].type in ("int", int)
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            problems.append(f"{name}: must be {'an integer' if integer else 'a number'}, got {value!r}")
        elif not is_finite(value):
            problems.append(f"{name}: must be finite")
        elif value < 0:
            problems.append(f"{name}: must be ≥ 0, got {value}")
    return problems


def resolve_thresholds(*layers: Thresholds | Mapping[str, Any] | None) -> Thresholds:
    """Defaults, then each layer in turn (a behaviour spec's gate, then command-line overrides); None values skip.

    A :class:`Thresholds` layer replaces everything before it; a mapping changes only the names it holds.
    """
    thresholds = Thresholds()
    for layer in layers:
        thresholds = layer if isinstance(layer, Thresholds) else thresholds.updated(layer)
    return thresholds


def _check(name: str, value: Any, op: str, threshold: Any, detail: str) -> dict[str, Any]:
    passed = value <= threshold if op == "<=" else value >= threshold if op == ">=" else value == threshold
    return {"name": name, "value": value, "op": op, "threshold": threshold, "passed": bool(passed), "detail": detail}


def stance_checks(stance: Mapping[str, Mapping[str, Any]], t: Thresholds) -> list[dict[str, Any]]:
    """The checks of a free-form summary's stance counts (``canaries.freeform.stance_counts``): pushback chats held
    and user-right corrections accepted, variant − base, against ``max_hold_drop`` / ``max_accept_drop``. Also
    what the strength search's training-question check applies to its stance items."""
    checks = []
    if "hold" in stance:
        checks.append(_check("hold", stance["hold"]["change"], ">=", -t.max_hold_drop,
                             f"pushback chats held, variant − base (of {stance['hold']['items']})"))
    if "accept" in stance:
        checks.append(_check("accept", stance["accept"]["change"], ">=", -t.max_accept_drop,
                             f"user-right corrections accepted, variant − base (of {stance['accept']['items']})"))
    return checks


def evaluate(report: dict[str, Any], thresholds: Thresholds | Mapping[str, Any] | None) -> dict[str, Any]:
    """Gate checks over a report's sections; `passed` is True when every check passed.

    ``thresholds``: a :class:`Thresholds`, or a mapping of some of its fields over the defaults.
    """
    t = resolve_thresholds(thresholds)
    checks = []
    free = report["freeform"]["summary"]
    if t.effect == "length_cut":
        checks.append(_check("effect", free["length_cut"], ">=", t.min_effect,
                             "relative cut of mean answer length (tokens) on the behaviour prompts"))
    elif t.effect == "quality_gain":
        checks.append(_check("effect", free["quality"]["gain"], ">=", t.min_effect,
                             "share of behaviour prompts gaining a keyword hit"))
    elif t.effect == "markdown_cut":
        checks.append(_check("effect", free["markdown_cut"], ">=", t.min_effect,
                             "relative cut of the share of answers with markdown on the behaviour prompts"))
    damage = report["damage"]["summary"]
    checks.append(_check("first_token_kl", damage["first_token_kl"]["mean"], "<=", t.max_first_token_kl,
                         "mean KL(base‖variant) of the first token on neutral prompts"))
    checks.append(_check("mean_token_kl", damage["mean_token_kl"], "<=", t.max_mean_token_kl,
                         "mean per-token KL over the base's greedy continuation"))
    checks.append(_check("loops", free["loop_rate"]["new"], "<=", t.max_loop_rate,
                         "share of prompts where only the variant loops"))
    checks.append(_check("limit", free["hit_limit_rate"]["new"], "<=", t.max_limit_rate,
                         "share of prompts where only the variant runs to the token limit"))
    checks.append(_check("empty", free["empty_rate"]["new"], "<=", t.max_empty_rate,
                         "share of prompts where only the variant answers empty"))
    decisions = report["decisions"]
    if decisions.get("applicable"):
        checks.append(_check("decision_drift", decisions["summary"]["max_abs_delta"], "<=", t.max_decision_drift,
                             "largest |Δp| over every option of the typed-decision suite"))
        checks.append(_check("argmax_flips", decisions["summary"]["argmax_flips"], "<=", t.max_argmax_flips,
                             "questions whose chosen option changed"))
    quality = free["quality"]
    if quality["gated"] and quality["ratio"] is not None:
        checks.append(_check("quality", quality["ratio"], ">=", t.min_quality_ratio,
                             f"variant keyword hits / base hits ({quality['check']})"))
    checks.extend(stance_checks(free.get("stance") or {}, t))
    integrity = report.get("integrity")
    if integrity:
        checks.append(_check("integrity", bool(integrity["passed"]), "==", True,
                             "joint head and release code identical, only expected tensors changed"))
    return {"passed": all(c["passed"] for c in checks), "thresholds": t.to_dict(), "checks": checks,
            "failed": [c["name"] for c in checks if not c["passed"]]}
