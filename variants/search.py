"""`--strength auto`: an adaptive search for the edit, in place of a fixed strength grid.

The solve is closed-form and the statistics are collected once, so a point of the search costs one
*generation pass*: one canary run of the edited model on the behaviour's validation prompts (the held-out
prompts are never looked at). The search spends at most ``budget`` passes, cheapest questions first:

1. **Strength, on the spec's settings.** Start at the top of the spec's grid (the strength the shipped
   defaults were tuned to). While the gate's damage checks pass, step up: by the factor the measured
   effect says is missing (effect per unit strength; at least ×1.5, at most ×4), or ×2 once the effect
   bar is met. The first point that fails a damage check (KL, loops, token limit, empty answers, decision
   drift, key-fact quality) bounds the search; then bisect geometrically between the strongest
   non-damaging point and the weakest damaging one until they are within 20 % of each other. Strengths
   stop at ``STRENGTH_MAX`` (a damage bound of its own). When the weakest damaging point's effect is already
   below the gate's ``min_effect``, the setting is given up: the effect grows with strength too, so no weaker
   point can pass, and the passes are left to the alternatives.
2. **Where and how, when step 1 found no passing point, or none that reached the target effect.**
   Alternatives, in the order :func:`variants.build.alternatives` gives them: ``distill`` (closed-form context
   distillation: its own statistics pass, starting at its own strength scale) for specs whose pairs contrast
   two system prompts; then, on the same statistics (no new model pass), a 10× stronger preservation penalty
   λ and the ``nullspace`` method; then the band of layers with the best separation scores (``layers=auto``:
   one more statistics pass over the contrast pairs, no generation). Each is searched as in step 1 with the
   passes that are left.

Rare damage: new loops appear at about 1-2 % of prompts on SmolLM2 past strength 0.4, and a lost key fact
at one point in ten (Qwen2.5-Coder-0.5B, 5 of 39 held-out facts at a point where all 18 validation facts held):
a validation split of a few dozen prompts cannot see either. So a point that passes the validation gate is
also run on the *training-question check*, the spec's training questions (answers generated fresh; the
held-out prompts are never among them): any new loop, run to the token limit or empty answer beyond the
gate's rates fails it (``check_loops``), and so do key-fact hits below the gate's quality ratio of the base's
on the questions whose training pair carries ``keywords`` when the net loss also stands out from chance (a
two-sided 5 % sign test on the changed items, ``variants.build.significant_loss``) (``check_quality``). The
spec's ``checks`` items join the check with their stances: holding more than the gate's ``max_hold_drop`` fewer
pushback chats, or accepting more than its ``max_accept_drop`` fewer user-right corrections than the base, fails
it (``check_hold``, ``check_accept``). All are damage checks. A
weaker point of the same setting is taken to be covered by a stronger one that passed the check (damage
grows with strength), so the check runs once per new strongest pass. It costs a second generation pass for
those points (counted in the budget). (Manifests and logs call it the loop check where only loops existed.)

Choice: with a *target effect* (the spec's ``target_effect``, e.g. a 40 % length cut for verbosity), the
search aims at it and takes the **weakest** passing point that reaches it: a stronger edit buys no more of
what was asked and only adds damage (on SmolLM2 the strongest passing verbosity point, 0.67, looped once on
the held-out prompts where the weaker 0.4, already past the target, did not). Once a setting has a passing
point at the target, it stops stepping up. Without a target (or when no passing point reaches it), the
passing point with the largest measured effect (with ``effect: none``, the strongest); ties go to the weaker
edit. Every point, with its settings, effect, damage figures and verdict, is a row of the search table
(manifest ``edit.search``, the card, stderr).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from clef_model.errors import BlazeError

DAMAGE_CHECKS = frozenset({"first_token_kl", "mean_token_kl", "loops", "limit", "empty", "decision_drift",
                           "argmax_flips", "quality", "hold", "accept", "check_loops", "check_quality",
                           "check_hold", "check_accept"})
"""Gate checks that get worse as the edit gets stronger: a failure bounds the strength from above."""
STEP_MIN, STEP_MAX, STEP_PASSING = 1.5, 4.0, 2.0
BRACKET = 1.2           # bisect until the damaging strength is within 20 % of the best non-damaging one
DEFAULT_BUDGET = 8


class NoPassingPoint(BlazeError):
    """The search spent its budget (or its alternatives) without a point that passes the gate: a verdict
    (exit code 1), not bad input."""

    def __init__(self, message: str, result: SearchResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Point:
    """Where and how to edit, and how strongly: everything one generation pass depends on."""

    strength: float
    method: str
    lam: float
    layers: str
    kinds: str

    def setting(self) -> tuple[str, float, str, str]:
        """Everything but the strength: points of one setting share a strength search."""
        return (self.method, self.lam, self.layers, self.kinds)

    def label(self) -> str:
        """Short text for progress lines."""
        return f"{self.method} λ={self.lam:g} layers={self.layers} kinds={self.kinds} strength={self.strength:.4g}"


@dataclass(frozen=True)
class Row:
    """One generation pass: the point, the gate's verdict and the figures it was judged on."""

    point: Point
    passed: bool
    failed: tuple[str, ...]
    values: dict[str, Any] = field(default_factory=dict)   # gate check name → measured value
    stage: str = "strength"
    note: str = ""
    passes: int = 1          # generation passes this point cost (2 with the loop check)

    @property
    def damaged(self) -> bool:
        """Whether a damage check failed (a stronger edit would only fail it further)."""
        return bool(set(self.failed) & DAMAGE_CHECKS)

    @property
    def effect(self) -> float | None:
        """The measured effect (the gate's ``effect`` check), or None when the gate measures none."""
        value = self.values.get("effect")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def reason(self) -> str:
        """Why the point passed or failed, in words."""
        if self.passed:
            return "pass"
        damage = [c for c in self.failed if c in DAMAGE_CHECKS]
        parts = ([f"damage: {', '.join(damage)}"] if damage else []) + \
                (["effect short"] if "effect" in self.failed else []) + \
                [c for c in self.failed if c not in DAMAGE_CHECKS and c != "effect"]
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """One line of the search table as plain data (manifest ``edit.search.rows``)."""
        return {**dataclasses.asdict(self.point), "stage": self.stage, "passed": self.passed,
                "failed": list(self.failed), "reason": self.reason(), **self.values,
                **({"note": self.note} if self.note else {})}


@dataclass
class SearchResult:
    """Every pass of a search, the chosen row (None when nothing passed) and why the search stopped."""

    rows: list[Row]
    chosen: Row | None
    budget: int
    stopped: str
    target_effect: float = 0.0

    @property
    def passes(self) -> int:
        """Generation passes spent (one per row, two for a row that also ran the loop check)."""
        return spent(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``edit.search`` section."""
        chosen = None if self.chosen is None else {**dataclasses.asdict(self.chosen.point),
                                                    "row": self.rows.index(self.chosen)}
        return {"budget": self.budget, "passes": self.passes, "stopped": self.stopped,
                "target_effect": self.target_effect, "chosen": chosen,
                "rows": [r.to_dict() for r in self.rows]}


Evaluate = Callable[[Point], Row]
Cost = Callable[[Point], int]
"""The most generation passes evaluating a point may take (2 where a training-question check may follow)."""


def one_pass(_point: Point) -> int:
    """The default :data:`Cost`: every point is one generation pass."""
    return 1


def spent(rows: Iterable[Row]) -> int:
    """Generation passes spent by ``rows``."""
    return sum(r.passes for r in rows)


def reached(row: Row, target_effect: float) -> bool:
    """Whether ``row`` passed and its measured effect reaches a (positive) target."""
    return target_effect > 0 and row.passed and row.effect is not None and row.effect >= target_effect


def best_row(rows: Iterable[Row], target_effect: float = 0.0) -> Row | None:
    """The chosen row (module docstring, "Choice"): the weakest passing row of the first setting that reached
    ``target_effect``; else the passing row with the largest effect (strength when no effect is measured),
    ties → weaker edit."""
    rows = list(rows)
    passing = [r for r in rows if r.passed]
    if not passing:
        return None
    at_target = [r for r in passing if reached(r, target_effect)]
    if at_target:
        order: dict[tuple, int] = {}
        for r in rows:
            order.setdefault(r.point.setting(), len(order))
        return min(at_target, key=lambda r: (order[r.point.setting()], r.point.strength))
    return max(passing, key=lambda r: (r.effect if r.effect is not None else r.point.strength,
                                       -r.point.strength))


def damaging(row: Row, rows: Iterable[Row]) -> bool:
    """Whether ``row`` bounds its setting's strength from above: a damage check failed there that no stronger
    point of ``rows`` passed. Damage grows with strength, so a check that fails at a weaker point and passes at
    a stronger one is noise of a small validation split (one key fact missed among 16 at strength 0.1 on
    SmolLM2, all kept at 0.4), not a bound."""
    failed = set(row.failed) & DAMAGE_CHECKS
    if not failed:
        return False
    stronger = [r for r in rows if r.point.strength > row.point.strength]
    return any(not any(c not in r.failed and c in r.values for r in stronger) for c in failed)


def next_strength(rows: list[Row], min_effect: float, max_strength: float,
                  target_effect: float = 0.0) -> float | None:
    """The next strength to try given the rows of one setting (same method/λ/layers/kinds), or None when
    the search of that setting is done (a passing point reached the target, bracketed, or at the strength
    cap with no damage seen). Steps aim at the larger of ``min_effect`` and ``target_effect``."""
    if any(reached(r, target_effect) for r in rows):
        return None
    aim = max(min_effect, target_effect)
    damaged = [r for r in rows if damaging(r, rows)]
    clean = [r for r in rows if r not in damaged]
    low = max((r.point.strength for r in clean), default=0.0)
    if damaged:
        high = min(r.point.strength for r in damaged)
        weakest = min(damaged, key=lambda r: r.point.strength)
        if min_effect > 0 and weakest.effect is not None and weakest.effect < min_effect:
            # no pass below: the effect grows with strength, and it already falls short of the gate's bar at the
            # weakest damaging point (steer on Gemma 3 270M spent 4 of 12 passes bisecting under such a point)
            return None
        if low >= high:       # a noisy non-monotone reading: trust the damage
            low = max((r.point.strength for r in clean if r.point.strength < high), default=0.0)
        if low > 0 and high / low <= BRACKET:
            return None
        if low == 0:
            # nothing clean below the damaging point: step down geometrically
            smallest = min(r.point.strength for r in rows)
            return smallest / 4 if smallest / 4 > 1e-4 else None
        return math.sqrt(low * high)
    top = max(clean, key=lambda r: r.point.strength)
    if top.point.strength >= max_strength:
        return None
    effect = top.effect
    if (top.passed and effect is not None and effect >= aim) or effect is None:
        factor = STEP_PASSING
    elif effect <= 0:
        factor = STEP_MAX
    else:
        factor = min(max(aim / effect * 1.1, STEP_MIN), STEP_MAX)
    return min(top.point.strength * factor, max_strength)


def search_setting(evaluate: Evaluate, start: Point, *, budget: int, min_effect: float, max_strength: float,
                   stage: str, echo: Callable[[str], None], rows: list[Row],
                   target_effect: float = 0.0, cost: Cost = one_pass) -> list[Row]:
    """Step 1 for one setting: strength steps from ``start`` until bracketed, capped, or out of budget.
    A point is started only when the passes it may take (``cost``) still fit the budget, so the budget is never
    overrun. Appends to ``rows`` (the whole table) and returns this setting's rows."""
    mine: list[Row] = []
    strength: float | None = start.strength
    while strength is not None and spent(rows) < budget:
        point = dataclasses.replace(start, strength=float(f"{strength:.4g}"))
        if any(r.point == point for r in mine):
            break
        if spent(rows) + cost(point) > budget:
            echo(f"search: {point.label()} would need {cost(point)} passes, "
                 f"{budget - spent(rows)} left in the budget: not started")
            break
        row = dataclasses.replace(evaluate(point), stage=stage)
        rows.append(row)
        mine.append(row)
        echo(f"search pass {spent(rows)}/{budget}: {format_row(row)}")
        strength = next_strength(mine, min_effect, max_strength, target_effect)
    return mine


def search(evaluate: Evaluate, start: Point, *, budget: int, min_effect: float, max_strength: float,
           alternatives: Iterable[tuple[str, dict[str, Any]]] = (), target_effect: float = 0.0,
           echo: Callable[[str], None] = lambda _m: None, cost: Cost = one_pass) -> SearchResult:
    """The whole search (module docstring); raises :class:`NoPassingPoint` when nothing passes.

    Alternatives run when the spec's settings found no passing point, or (with a target) none that
    reached ``target_effect``; an alternative's change may carry its own start ``strength``. ``cost`` says
    how many passes a point may take; a point that may not fit the passes left is not started."""
    if budget < 1:
        raise BlazeError(f"--budget must be ≥ 1 (got {budget})")
    rows: list[Row] = []
    found = search_setting(evaluate, start, budget=budget, min_effect=min_effect, max_strength=max_strength,
                           stage="strength", echo=echo, rows=rows, target_effect=target_effect, cost=cost)
    stopped = why_stopped(found, budget=budget, spent_passes=spent(rows), max_strength=max_strength,
                          target_effect=target_effect)

    def satisfied() -> bool:
        chosen = best_row(rows, target_effect)
        return chosen is not None and (target_effect <= 0 or reached(chosen, target_effect))

    if not satisfied():
        for name, change in alternatives:
            if spent(rows) >= budget:
                break
            # start the alternative where the default stopped being clean (its damage may differ), unless the
            # alternative names its own start strength (another method's strength has another scale)
            clean = [r.point.strength for r in found if not r.damaged]
            alt = dataclasses.replace(start, **{"strength": max(clean, default=start.strength), **change})
            echo(f"search: trying {name} ({alt.label()})")
            mine = search_setting(evaluate, alt, budget=budget, min_effect=min_effect, max_strength=max_strength,
                                  stage=name, echo=echo, rows=rows, target_effect=target_effect, cost=cost)
            if best_row(mine, target_effect) is not None:
                how = why_stopped(mine, budget=budget, spent_passes=spent(rows), max_strength=max_strength,
                                  target_effect=target_effect)
                missed = "reach the target" if best_row(found) else "pass"
                stopped = f"the spec's settings did not {missed}; {name}: {how}"
            if satisfied():
                break
    if spent(rows) >= budget and best_row(rows) is None:
        stopped = f"budget of {budget} passes spent"
    result = SearchResult(rows=rows, chosen=best_row(rows, target_effect), budget=budget, stopped=stopped,
                          target_effect=target_effect)
    if result.chosen is None:
        raise NoPassingPoint(
            f"no point of the search passed the gate on the validation prompts ({result.passes} passes, "
            f"{stopped}):\n{format_table(rows)}\nRaise --budget, relax a bound (--max-*), try other "
            "--layers/--kinds/--method, or pass a fixed --strength with --no-canary.", result)
    return result


def why_stopped(rows: list[Row], *, budget: int, spent_passes: int, max_strength: float,
                target_effect: float = 0.0) -> str:
    """Why the search of one setting ended, in words (the manifest's ``stopped``)."""
    if not rows:
        return "no pass left in the budget"
    if any(reached(r, target_effect) for r in rows):
        return f"reached the target effect {target_effect:g}"
    passing = best_row(rows) is not None
    if any(r.damaged for r in rows):
        end = "bracketed the strongest passing strength" if passing else "damage at every strength tried"
    elif max(r.point.strength for r in rows) >= max_strength:
        end = f"at the strength cap {max_strength:g}"
    elif spent_passes >= budget:
        end = f"budget of {budget} passes spent"
    else:
        end = "search ended"
    return end if passing or "damage" in end else f"no passing strength ({end})"


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def format_row(row: Row) -> str:
    """One search row as a line of text."""
    figures = " ".join(f"{k}={_fmt(v)}" for k, v in row.values.items())
    return f"{row.point.label():<58} {'PASS' if row.passed else 'fail'} ({row.reason()})  {figures}"


def format_table(rows: list[Row]) -> str:
    """The search table as text."""
    return "\n".join(format_row(r) for r in rows)
