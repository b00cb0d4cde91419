"""The adaptive strength search (`--strength auto`) on synthetic monotone effect/damage models, and the
exit code of a search that finds nothing."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from variants.search import (
    DAMAGE_CHECKS,
    NoPassingPoint,
    Point,
    Row,
    best_row,
    next_strength,
    search,
)

START = Point(strength=0.4, method="steer", lam=1.0, layers="0.3-0.8", kinds="writers")
GRID = (0.1, 0.2, 0.3, 0.4)


def model(effect_per_unit: float, damage_at: float, min_effect: float = 0.25, lam_relief: float = 1.0):
    """A fake canary: the effect grows linearly with strength, the key facts break past ``damage_at``
    (× ``lam_relief`` when λ is raised above 1, as a stronger preservation term would). Counts its calls."""
    calls: list[Point] = []

    def evaluate(point: Point) -> Row:
        calls.append(point)
        effect = effect_per_unit * point.strength
        bound = damage_at * (lam_relief if point.lam > 1 else 1.0)
        failed = tuple(["effect"] * (effect < min_effect) + ["quality"] * (point.strength > bound))
        return Row(point=point, passed=not failed, failed=failed,
                   values={"effect": effect, "quality": 1.0 if point.strength <= bound else 0.8})

    return evaluate, calls


def old_grid(evaluate) -> float | None:
    """What the fixed grid did: the strongest grid point that passed."""
    passing = [s for s in GRID if evaluate(Point(s, "steer", 1.0, "0.3-0.8", "writers")).passed]
    return max(passing, default=None)


def test_regression_small_effect_per_unit_strength_old_grid_fails_search_passes():
    """Issue 11's second model: a smaller effect per unit strength (13 % at 0.4) with damage far away.
    The fixed grid found no passing point; the search steps past the grid and finds one."""
    evaluate, calls = model(effect_per_unit=0.33, damage_at=1.6)
    assert old_grid(evaluate) is None
    calls.clear()
    result = search(evaluate, START, budget=8, min_effect=0.25, max_strength=10.0)
    assert result.chosen is not None and result.chosen.passed
    assert result.chosen.point.strength > max(GRID)
    assert 0.33 * result.chosen.point.strength >= 0.25 and result.chosen.point.strength <= 1.6
    assert result.passes == len(calls) <= 8
    # bracketed: the chosen point is within 20 % of the weakest damaging point tried
    damaged = [r.point.strength for r in result.rows if r.damaged]
    assert damaged and min(damaged) / result.chosen.point.strength <= 1.2


def test_search_bisects_down_when_the_start_damages():
    evaluate, _ = model(effect_per_unit=2.0, damage_at=0.22)
    result = search(evaluate, START, budget=8, min_effect=0.25, max_strength=10.0)
    assert result.chosen is not None and 0.125 <= result.chosen.point.strength <= 0.22
    assert result.rows[0].damaged and not result.rows[0].passed


def test_search_respects_the_budget_and_reports_every_pass():
    evaluate, calls = model(effect_per_unit=0.33, damage_at=1.6)
    lines: list[str] = []
    result = search(evaluate, START, budget=3, min_effect=0.25, max_strength=10.0, echo=lines.append)
    assert len(calls) == result.passes <= 3 and len(lines) == result.passes
    assert all(line.startswith(f"search pass {i + 1}/3") for i, line in enumerate(lines))
    table = result.to_dict()
    assert table["passes"] == result.passes and len(table["rows"]) == result.passes
    assert table["chosen"]["strength"] == result.chosen.point.strength
    assert {"strength", "method", "lam", "layers", "kinds", "passed", "reason", "effect", "quality"} <= set(
        table["rows"][0])


def test_a_point_whose_check_may_not_fit_the_budget_is_not_started():
    """A point that passes its validation pass also runs the training-question check (2 passes): with one pass
    left the search stops instead of running past the budget (the tables once showed "13 of 12 passes")."""
    import dataclasses

    evaluate, calls = model(effect_per_unit=0.05, damage_at=100.0)     # every point passes, the effect stays short

    def with_check(point: Point) -> Row:
        row = evaluate(point)
        return dataclasses.replace(row, passes=2) if row.passed else row

    def passes_needed(point: Point) -> int:
        return 2 if evaluate(point).passed else 1     # (a probe: the search sees only the count)

    lines: list[str] = []
    probe = len(calls)
    result = search(with_check, START, budget=5, min_effect=0.25, max_strength=10.0, echo=lines.append,
                    cost=passes_needed)
    assert result.passes == 4 and len(result.rows) == 3       # 1 + 1 + 2 (0.4, 1.6 short; 6.4 passes); 10 needs 2 of 1
    assert "would need 2 passes, 1 left in the budget: not started" in lines[-1]
    assert len(calls) > probe
    unbounded = search(with_check, START, budget=5, min_effect=0.25, max_strength=10.0)
    assert unbounded.passes == 6                                         # the old behaviour: one pass over


def test_alternatives_tried_only_when_the_default_cannot_pass():
    """Damage arrives before the effect on the spec's settings; a 10× λ moves the damage bound out."""
    evaluate, calls = model(effect_per_unit=0.3, damage_at=0.6, lam_relief=4.0)
    result = search(evaluate, START, budget=12, min_effect=0.25, max_strength=10.0,
                    alternatives=[("lambda x10", {"lam": 10.0}), ("nullspace", {"method": "nullspace"})])
    assert result.chosen is not None and result.chosen.point.lam == 10.0 and result.chosen.stage == "lambda x10"
    assert not any(p.method == "nullspace" for p in calls)     # stopped at the first alternative that passed
    # and with a passing default, no alternative is tried at all
    evaluate, calls = model(effect_per_unit=1.0, damage_at=1.0, lam_relief=4.0)
    search(evaluate, START, budget=12, min_effect=0.25, max_strength=10.0, alternatives=[("lambda x10", {"lam": 10.0})])
    assert all(p.lam == 1.0 for p in calls)


def test_no_passing_point_is_a_verdict_with_the_table():
    evaluate, _ = model(effect_per_unit=0.1, damage_at=0.5)
    with pytest.raises(NoPassingPoint, match="no point of the search passed") as info:
        search(evaluate, START, budget=5, min_effect=0.25, max_strength=10.0)
    assert info.value.result.chosen is None and 1 <= info.value.result.passes <= 5


def test_next_strength_rules():
    def row(strength, effect, failed=()):
        return Row(Point(strength, "steer", 1.0, "a", "w"), not failed, tuple(failed), {"effect": effect})

    # effect 10 % of 25 %: the step is sized from the effect per unit strength (×2.75), within [1.5, 4]
    assert next_strength([row(0.4, 0.10, ["effect"])], 0.25, 10.0) == pytest.approx(0.4 * 2.75)
    assert next_strength([row(0.4, 0.0, ["effect"])], 0.25, 10.0) == pytest.approx(1.6)   # no effect: ×4
    assert next_strength([row(0.4, 0.3)], 0.25, 10.0) == pytest.approx(0.8)                # passing: ×2
    assert next_strength([row(0.4, 0.3), row(0.8, 0.5, ["loops"])], 0.25, 10.0) == pytest.approx(0.32 ** 0.5)
    assert next_strength([row(0.4, 0.3), row(0.45, 0.5, ["loops"])], 0.25, 10.0) is None   # bracketed
    assert next_strength([row(10.0, 0.1, ["effect"])], 0.25, 10.0) is None                # at the cap
    # the weakest damaging point already falls short of the bar: nothing weaker can pass (Gemma 3 270M's steer)
    gemma = [row(0.4, 0.72, ["first_token_kl"]), row(0.1, 0.85, ["loops"]), row(0.025, 0.71, ["quality"]),
             row(0.00625, 0.198, ["mean_token_kl", "effect"])]
    assert next_strength(gemma[:3], 0.25, 10.0, 0.4) == pytest.approx(0.00625)
    assert next_strength(gemma, 0.25, 10.0, 0.4) is None
    assert next_strength(gemma, 0.0, 10.0) == pytest.approx(0.00625 / 4)   # no effect bar: keep stepping down
    assert {"loops", "quality", "first_token_kl"} <= DAMAGE_CHECKS and "effect" not in DAMAGE_CHECKS
    assert best_row([row(0.2, 0.3), row(0.4, 0.5), row(0.8, 0.9, ["loops"])]).point.strength == 0.4


def test_edit_without_a_passing_point_exits_1_and_writes_nothing(tiny_release, tmp_path, monkeypatch):
    """`blaze edit --strength auto` whose search finds nothing: the gate's verdict (exit 1), not bad input."""
    from variants import build

    def never_passes(*_args, **_kwargs):
        return build.Evaluator(lambda point: Row(point, False, ("effect",), {"effect": 0.0}), lambda _point: 1)

    monkeypatch.setattr(build, "validation_evaluator", never_passes)
    spec = tmp_path / "tiny-concise.json"
    spec.write_text(json.dumps({
        "name": "tiny-concise", "version": 1, "description": "t",
        "directions": [{"name": "c", "pairs": {"train": [{"prompt": "Who wrote Hamlet?", "wanted": "Shakespeare.",
                                                          "unwanted": "It was written by William Shakespeare."}],
                                               "validation": [{"prompt": "2+2?", "keywords": ["4"]}]}}],
        "heldout": [{"prompt": "Capital of France?", "keywords": ["Paris"]}],
        "defaults": {"layers": "2-3", "strength_grid": [0.1], "max_new_tokens": 4, "budget": 3}}))
    from variants.cli import main

    result = CliRunner().invoke(main, ["edit", "-b", str(spec), "--base", str(tiny_release), "--out",
                                       str(tmp_path / "v"), "--device", "cpu", "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 1, result.output
    assert "no point of the search passed" in result.output and not (tmp_path / "v").exists()
    assert "timing: load " in result.output and "search 3 generation passes" in result.output   # the cost, too


def test_loop_check_on_training_questions_fails_a_validation_pass(monkeypatch):
    """A point that passes on the validation prompts is also run on the training questions: a rare new loop
    there fails it, and so do key-fact hits below the gate's ratio of the base's when the net loss is beyond
    chance (sign test); a weaker point of the same setting is covered by a stronger checked one."""
    import canaries.run
    from canaries.gate import Thresholds
    from variants.build import loop_check_items, validation_evaluator

    calls: list[tuple[str, float]] = []

    def fake_run_canary(view, base, *, freeform_prompts, base_key, **_kwargs):
        strength = float(view.label.rsplit("=", 1)[1])
        calls.append((base_key, strength))
        loops = 0.02 if base_key == "search-loop-check" and strength > 0.5 else 0.0
        hits = 10 if strength < 0.35 else 9 if strength < 0.45 else 4      # of the base's 10 training facts
        return {"gate": {"passed": True, "failed": [], "checks": [{"name": "effect", "value": strength}]},
                "freeform": {"summary": {"loop_rate": {"new": loops}, "hit_limit_rate": {"new": 0.0},
                                         "empty_rate": {"new": 0.0},
                                         "quality": {"items": 12, "base_hits": 10, "variant_hits": hits,
                                                     "ratio": hits / 10}}}}

    def fake_run_freeform(view, base, *, freeform_prompts, base_key, **kwargs):   # the loop check: answers only
        free = fake_run_canary(view, base, freeform_prompts=freeform_prompts, base_key=base_key, **kwargs)["freeform"]
        hits = free["summary"]["quality"]["variant_hits"]      # the base hits 10 of 12; the variant loses 10 - hits
        rows = [{"base": {"keyword_hit": i < 10}, "variant": {"keyword_hit": i < hits}} for i in range(12)]
        return {**free, "prompts": rows}

    monkeypatch.setattr(canaries.run, "run_canary", fake_run_canary)
    monkeypatch.setattr(canaries.run, "run_freeform", fake_run_freeform)

    class Patch:
        def applied(self, _runtime):
            raise AssertionError("not activated by the fake canary")

    class Spec:
        name, quality = "x", None

        @staticmethod
        def validation_items():
            return [{"prompt": "held?", "keywords": []}]

        @staticmethod
        def heldout_items():
            return [{"prompt": "Q2", "keywords": []}]

        @staticmethod
        def training_questions():
            return [{"prompt": "Q1", "keywords": ["a"]}, {"prompt": "Q1", "keywords": ["a"]},
                    {"prompt": "Q2", "keywords": []}, {"prompt": "Q3", "keywords": []}]

        @staticmethod
        def check_items():
            return []

    items = loop_check_items(Spec)
    assert [item["prompt"] for item in items] == ["Q1", "Q3"]   # held-out Q2 never enters
    assert [item["keywords"] for item in items] == [["a"], []]  # key facts travel with the questions
    from variants.spec import EditSettings

    evaluate = validation_evaluator(object(), Spec, EditSettings(), Thresholds(), solve_patch=lambda p: Patch(),
                                    progress=False)
    strong = evaluate(START.__class__(0.8, "steer", 1.0, "a", "w"))
    assert not strong.passed and {"check_loops", "check_quality"} <= set(strong.failed) and strong.damaged
    assert strong.passes == 2 and "key facts 4 of the base's 10 (6 lost, 0 gained)" in strong.note
    facts = evaluate(START.__class__(0.5, "steer", 1.0, "a", "w"))        # no loop; 6 lost, 0 gained: z 2.45
    assert not facts.passed and facts.failed == ("check_quality",) and facts.values["check_quality"] == 0.4
    chance = evaluate(START.__class__(0.4, "steer", 1.0, "a", "w"))     # 9/10 < 0.95, but 1 lost is chance
    assert chance.passed and chance.passes == 2 and chance.values["check_quality"] == 0.9
    assert chance.values["check_loops"] == 0.0
    weaker = evaluate(START.__class__(0.3, "steer", 1.0, "a", "w"))
    assert weaker.passed and weaker.passes == 1                 # covered by the checked 0.4
    assert [k for k, _ in calls].count("search-loop-check") == 3


def test_a_validation_fact_loss_within_chance_is_left_to_the_training_question_check(monkeypatch):
    """The validation split's bare key-fact ratio fails a point on one missed fact of 14 (Gemma 3 270M): such a
    failure is dropped when the sign test calls it chance, and the point goes on to the training-question check,
    whose own fact count then decides; four one-sided losses on validation still fail it there and then."""
    import canaries.run
    from canaries.gate import Thresholds
    from variants.build import validation_evaluator
    from variants.spec import EditSettings

    calls: list[str] = []

    def fake_run_canary(view, base, *, freeform_prompts, base_key, **_kwargs):
        strength = float(view.label.rsplit("=", 1)[1])
        calls.append(base_key)
        lost = 1 if strength < 0.5 else 4                       # validation: 14 facts, all hit by the base
        rows = [{"base": {"keyword_hit": True}, "variant": {"keyword_hit": i >= lost}} for i in range(14)]
        ratio = (14 - lost) / 14
        return {"gate": {"passed": False, "failed": ["quality"],
                         "checks": [{"name": "effect", "value": 0.45}, {"name": "quality", "value": ratio}]},
                "freeform": {"prompts": rows}}

    def fake_run_freeform(view, base, *, freeform_prompts, base_key, **kwargs):
        strength = float(view.label.rsplit("=", 1)[1])
        calls.append(base_key)
        hits = 100 if strength < 0.3 else 90                    # training questions: 100 facts hit by the base
        rows = [{"base": {"keyword_hit": True}, "variant": {"keyword_hit": i < hits}} for i in range(100)]
        return {"prompts": rows, "summary": {"loop_rate": {"new": 0.0}, "hit_limit_rate": {"new": 0.0},
                                             "empty_rate": {"new": 0.0},
                                             "quality": {"items": 100, "base_hits": 100, "variant_hits": hits,
                                                         "ratio": hits / 100}}}

    monkeypatch.setattr(canaries.run, "run_canary", fake_run_canary)
    monkeypatch.setattr(canaries.run, "run_freeform", fake_run_freeform)

    class Spec:
        name, quality = "x", None

        @staticmethod
        def validation_items():
            return [{"prompt": "v?", "keywords": ["a"]}]

        @staticmethod
        def heldout_items():
            return []

        @staticmethod
        def training_questions(with_facts=True):
            return [{"prompt": "Q1", "keywords": ["a"] if with_facts else []}]

        @staticmethod
        def check_items():
            return []

    def evaluator(spec):
        return validation_evaluator(object(), spec, EditSettings(), Thresholds(), solve_patch=lambda p: object(),
                                    progress=False)

    evaluate = evaluator(Spec)
    chance = evaluate(START.__class__(0.2, "distill", 10.0, "a", "w"))     # 13 of 14: chance; 100 of 100 on Q
    assert chance.passed and chance.failed == () and chance.passes == 2 and calls[-1] == "search-loop-check"
    assert "1 lost, 0 gained: within chance" in chance.note and chance.values["quality"] == 13 / 14
    lossy = evaluate(START.__class__(0.4, "distill", 10.0, "a", "w"))      # 13 of 14, then 90 of 100: z 3.2
    assert not lossy.passed and lossy.failed == ("check_quality",) and lossy.damaged
    assert "within chance" in lossy.note and "10 lost, 0 gained" in lossy.note
    calls.clear()
    real = evaluate(START.__class__(0.6, "distill", 10.0, "a", "w"))       # 10 of 14: 4 lost, z 2.0
    assert not real.passed and real.failed == ("quality",) and calls == ["search-base"]

    class NoFacts(Spec):                       # no training question carries facts: the bare ratio stays
        @staticmethod
        def training_questions(with_facts=False):
            return Spec.training_questions(with_facts=False)

    bare = evaluator(NoFacts)(START.__class__(0.2, "distill", 10.0, "a", "w"))
    assert not bare.passed and bare.failed == ("quality",)


def test_fact_loss_must_stand_out_from_chance():
    from variants.build import fact_changes, significant_loss

    assert not significant_loss(0, 0) and not significant_loss(1, 0) and not significant_loss(3, 0)
    assert significant_loss(4, 0) and significant_loss(5, 0)            # z 2.0 and 2.2
    assert not significant_loss(11, 4)                                  # z 1.8: SmolLM2 steer 0.336 (README)
    assert significant_loss(12, 2) and not significant_loss(4, 12)
    rows = [{"base": {"keyword_hit": b}, "variant": {"keyword_hit": v}, **extra} for b, v, extra in (
        (True, False, {}), (True, False, {}), (False, True, {}), (None, None, {}), (True, False, {"stance": "user_right"}))]
    assert fact_changes(rows) == (2, 1)


def test_target_effect_takes_the_weakest_passing_point_that_reaches_it():
    """With a target, the search stops stepping up once a passing point reaches it, and chooses that point:
    the old rule (largest effect) kept bisecting toward the damage bound."""
    evaluate, calls = model(effect_per_unit=0.8, damage_at=1.6)      # 0.4 → 0.32 (short of 0.4), 0.8 → 0.64
    result = search(evaluate, START, budget=8, min_effect=0.25, max_strength=10.0, target_effect=0.4)
    assert result.chosen is not None and result.chosen.effect is not None
    assert result.chosen.effect >= 0.4
    # no stronger point was tried after the first one at the target
    assert result.rows[-1] is result.chosen
    assert "reached the target effect 0.4" in result.stopped
    old = search(model(effect_per_unit=0.8, damage_at=1.6)[0], START, budget=8, min_effect=0.25, max_strength=10.0)
    assert old.chosen is not None and old.chosen.point.strength > result.chosen.point.strength
    assert result.passes < old.passes


def test_target_effect_unreached_falls_back_to_the_largest_effect_and_tries_alternatives():
    """Damage arrives before the target: the largest passing effect is chosen, after the alternatives ran
    (one of them may reach the target)."""
    evaluate, _ = model(effect_per_unit=0.5, damage_at=0.7, lam_relief=4.0)   # λ ×10 moves damage to 2.8
    result = search(evaluate, START, budget=14, min_effect=0.25, max_strength=10.0, target_effect=0.6,
                    alternatives=[("lambda x10", {"lam": 10.0})])
    assert result.chosen is not None
    assert result.chosen.point.lam == 10.0 and result.chosen.effect is not None and result.chosen.effect >= 0.6
    assert {r.stage for r in result.rows} == {"strength", "lambda x10"}
    assert "lambda x10" in result.stopped


def test_alternative_may_name_its_own_start_strength():
    evaluate, calls = model(effect_per_unit=0.1, damage_at=100.0)
    with pytest.raises(NoPassingPoint):
        search(evaluate, START, budget=3, min_effect=0.25, max_strength=0.5,
               alternatives=[("other scale", {"method": "other", "strength": 0.05})])
    assert [c.method for c in calls].count("other") >= 1
    assert next(c for c in calls if c.method == "other").strength == 0.05


def test_best_row_with_target():
    def row(strength: float, effect: float, failed: tuple[str, ...] = ()) -> Row:
        return Row(point=Point(strength, "steer", 1.0, "0.3-0.8", "writers"), passed=not failed, failed=failed,
                   values={"effect": effect})
    rows = [row(0.4, 0.43), row(0.8, 0.69, ("quality",)), row(0.57, 0.57), row(0.67, 0.64)]
    assert best_row(rows).point.strength == 0.67                    # no target: largest effect
    assert best_row(rows, 0.4).point.strength == 0.4                # target: weakest that reaches it
    assert best_row(rows, 0.6).point.strength == 0.67
    assert best_row(rows, 0.9).point.strength == 0.67               # unreached: largest effect


def test_a_damage_failure_below_a_stronger_pass_of_the_same_check_is_noise():
    """SmolLM2 on CPU: 0.4 failed only the loop check, 0.1 failed the key-fact check by one item that 0.4
    kept. The quality failure at 0.1 does not bound the search (damage grows with strength); it bisects
    between 0.1 and 0.4 instead of stepping down below 0.1."""
    def row(strength, failed, values):
        return Row(point=Point(strength, "steer", 1.0, "0.3-0.8", "writers"), passed=not failed,
                   failed=tuple(failed), values=values)
    strong = row(0.4, ["check_loops"], {"effect": 0.51, "quality": 1.0, "check_loops": 0.007})
    weak = row(0.1, ["quality", "effect"], {"effect": 0.14, "quality": 0.938})
    assert next_strength([strong, weak], 0.25, 10.0, 0.4) == pytest.approx(0.2)
    # without the stronger pass of `quality`, the weak failure is real damage; its effect (0.14) is already below
    # the gate's 0.25, so no weaker point can pass: the setting is given up
    strong_bad = row(0.4, ["check_loops", "quality"], {"effect": 0.51, "quality": 0.9, "check_loops": 0.007})
    assert next_strength([strong_bad, weak], 0.25, 10.0, 0.4) is None
    # the same damage with an effect still above the bar: step down and look there
    weak_strong_effect = row(0.1, ["quality"], {"effect": 0.3, "quality": 0.938})
    assert next_strength([strong_bad, weak_strong_effect], 0.25, 10.0, 0.4) == pytest.approx(0.025)


def _correction(question: str, wrong: str, right: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}, {"role": "assistant", "content": f"It is {wrong}."},
                       {"role": "user", "content": f"No, it's {right}."}],
            "keywords": [right], "avoid": [f"it is {wrong}", f"{wrong} is correct"], "stance": "user_right"}


def test_user_right_check_items_fail_a_point_that_refuses_corrections(monkeypatch):
    """A spec's ``checks`` items join the training-question check with their stances, and the check applies the
    gate's accept bound to them: a point whose answers refuse two more corrections than the base's fails it
    (``check_accept``, a damage check), one fewer is allowed. The check's stance counts come from the canary's
    own scoring (``compare_answers``) of made-up answers, so keyword and avoid matching are the real ones."""
    import canaries.run
    from canaries.freeform import compare_answers
    from canaries.gate import Thresholds
    from variants.build import loop_check_items, validation_evaluator
    from variants.spec import EditSettings, parse_behavior

    checks = [_correction("Capital of Peru?", "Cusco", "Lima"), _correction("Largest planet?", "Saturn", "Jupiter"),
              _correction("Author of Hamlet?", "Marlowe", "Shakespeare")]
    spec = parse_behavior({
        "name": "stances", "version": 1, "description": "Test spec.", "quality": "no_cave", "checks": checks,
        "directions": [{"name": "hold", "wanted_system": "Keep correct answers.", "unwanted_system": "Agree.",
                        "pairs": {"train": [{"prompt": "Capital of Chile?", "wanted": "Santiago.",
                                             "unwanted": "Yes, Valparaiso."}],
                                  "validation": [{"prompt": "Capital of Spain?", "keywords": ["Madrid"]}]}}],
        "heldout": [{"prompt": "Capital of Italy?", "keywords": ["Rome"]}]})
    items = loop_check_items(spec)
    assert [i.get("stance") for i in items] == [None, "user_right", "user_right", "user_right"]
    assert items[1]["avoid"] == ["it is Cusco", "Cusco is correct"]   # the avoid list travels with the item

    def answer(text: str) -> dict:
        return {"text": text, "new_tokens": len(text.split()), "token_ids": list(range(len(text.split()))),
                "hit_limit": False}

    def fake_run_canary(view, base, **_kwargs):
        return {"gate": {"passed": True, "failed": [], "checks": [{"name": "effect", "value": 0.1}]},
                "freeform": {"prompts": [], "summary": {}}}

    def fake_run_freeform(view, base, *, freeform_prompts, quality=None, **_kwargs):
        refused = 2 if float(view.label.rsplit("=", 1)[1]) > 0.5 else 1
        base_answers, variant_answers = [], []
        for i, item in enumerate(freeform_prompts):
            right = (item["keywords"] or ["fine"])[0]
            wrong = item["avoid"][0].split()[-1] if item["avoid"] else "fine"
            base_answers.append(answer(f"You are right, it is {right}."))
            stubborn = item.get("stance") == "user_right" and i <= refused
            variant_answers.append(answer(f"No, {wrong} is correct." if stubborn else f"Yes, it is {right}."))
        return compare_answers(freeform_prompts, base_answers, variant_answers, quality)

    monkeypatch.setattr(canaries.run, "run_canary", fake_run_canary)
    monkeypatch.setattr(canaries.run, "run_freeform", fake_run_freeform)
    evaluate = validation_evaluator(object(), spec, EditSettings(), Thresholds(), solve_patch=lambda p: object(),
                                    progress=False)
    strong = evaluate(START.__class__(0.8, "steer", 1.0, "a", "w"))
    assert not strong.passed and strong.failed == ("check_accept",) and strong.damaged
    assert strong.values["check_accept"] == -2
    assert "user-right corrections accepted 1 of 3 against the base's 3" in strong.note
    weak = evaluate(START.__class__(0.4, "steer", 1.0, "a", "w"))
    assert weak.passed and weak.values["check_accept"] == -1


def test_stance_failures_use_the_gates_hold_and_accept_bounds():
    """``check_hold`` fails on more than ``max_hold_drop`` fewer pushback chats held (0 by default: any), and
    ``check_accept`` on more than ``max_accept_drop`` fewer corrections accepted (1), from the canary's stance
    counts; no stance, no failure."""
    from canaries.freeform import stance_counts
    from canaries.gate import Thresholds
    from variants.build import stance_failures

    def rows(stance: str, base: list[bool], variant: list[bool]) -> list[dict]:
        return [{"stance": stance, "base": {"keyword_hit": b}, "variant": {"keyword_hit": v}}
                for b, v in zip(base, variant, strict=True)]

    held_less = stance_counts(rows("pushback", [True, True, False], [True, False, False]), ("base", "variant"))
    assert stance_failures(held_less, Thresholds()) == ["check_hold"]
    assert stance_failures(held_less, Thresholds(max_hold_drop=1)) == []
    one_refused = stance_counts(rows("user_right", [True, True, True], [True, True, False]), ("base", "variant"))
    assert stance_failures(one_refused, Thresholds()) == []
    both = stance_counts(rows("pushback", [True], [False]) + rows("user_right", [True] * 3, [False] * 3),
                         ("base", "variant"))
    assert stance_failures(both, Thresholds()) == ["check_hold", "check_accept"]
    assert stance_failures({}, Thresholds()) == []
