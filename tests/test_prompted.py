"""The prompted ceiling: scoring with fake answers, the report sections, and the opt-in run on the tiny fixture
(cached, so a second canary against the same base does not ask the base again)."""

from __future__ import annotations

import json

import pytest

from canaries import freeform, prompted
from canaries.cache import DiskCache, MemoryCache
from canaries.report import print_report, to_markdown
from canaries.run import (
    ModelView,
    build_report,
    freeform_suite,
    run_canary,
    run_sequential,
)
from canaries.suites import default_decision_suite


def gen(text: str, n: int) -> dict:
    return {"text": text, "new_tokens": n, "token_ids": list(range(n)), "hit_limit": False}


ITEMS = [{"prompt": f"q{i}", "keywords": ["fact"], "source": "behavior"} for i in range(4)] + \
        [{"prompt": "general", "source": "general"}]
BASE = [gen("- fact\n- more", 20)] * 4 + [gen("hello", 3)]
VARIANT = [gen("- fact", 14), gen("- fact", 14), gen("fact plain", 14), gen("fact plain", 14), gen("hello", 3)]


def ceiling(prompted_answers, effect="length_cut", items=ITEMS, base=BASE, variant=VARIANT):
    section = freeform.compare_answers(items, base, variant, "keywords")
    return section, prompted.prompted_ceiling(section["prompts"], items, "Be brief.", prompted_answers, effect)


def effect(result: prompted.PromptedCeiling, name: str) -> prompted.CeilingEffect:
    return next(e for e in result.effects if e.name == name)


def test_edit_effect_as_a_fraction_of_the_prompted_effect():
    section, result = ceiling([gen("fact", 5)] * 4)
    assert result.items == 4 and result.system == "Be brief."                     # effect items only
    assert result.mean_tokens == {"base": 20.0, "variant": 14.0, "prompted": 5.0}
    length = effect(result, "length_cut")
    assert length.reachable and length.variant == pytest.approx(0.3) and length.prompted == pytest.approx(0.75)
    assert length.fraction == pytest.approx(0.3 / 0.75)
    markdown = effect(result, "markdown_cut")                                      # 4 → 2 (variant), 4 → 0 (prompt)
    assert (markdown.variant, markdown.prompted, markdown.fraction) == (2.0, 4.0, 0.5)
    assert result.markdown == {"items": 4, "base": 4, "variant": 2, "prompted": 0}
    assert result.quality == {"items": 4, "base_hits": 4, "variant_hits": 4, "prompted_hits": 4}
    assert result.gated_effect == "length_cut" and len(result.notes) == 1 and "40 %" in result.notes[0]
    assert section["prompts"][0]["prompted"]["tokens"] == 5 and "prompted" not in section["prompts"][4]
    json.dumps(result.to_dict())                                                   # plain data


def test_a_base_that_cannot_do_the_behaviour_when_asked_is_said_so():
    _, result = ceiling([gen("- fact\n- more", 19)] * 4)                          # 5 % shorter, same markdown
    length = effect(result, "length_cut")
    assert not length.reachable and length.fraction is None
    assert "does not do this behaviour even when asked" in result.notes[0]
    assert "within the noise margin of 10 %" in result.notes[0]
    assert not effect(result, "markdown_cut").reachable                            # 0 items < 3-item margin
    _, longer = ceiling([gen("a b c d e f g h i j k l m n o p q r s t u v w x y z", 40)] * 4)   # asked: longer
    assert "against the behaviour; the noise margin is 10 %" in longer.notes[0]


def test_count_margin_is_three_items():
    assert prompted._count_effect("x", "d", base=10, variant=11, prompted=12, items=40).reachable is False
    reached = prompted._count_effect("x", "d", base=10, variant=11, prompted=13, items=40)
    assert reached.reachable and reached.fraction == pytest.approx(1 / 3)


def test_without_a_gated_effect_every_effect_gets_a_note():
    _, result = ceiling([gen("fact", 5)] * 4, effect="none")
    assert result.gated_effect is None
    assert [n.split(":")[0] for n in result.notes] == ["length_cut", "markdown_cut", "quality_gain"]


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]


def test_stance_rates_for_base_variant_and_prompted():
    items = [{"prompt": chat(f"p{i}"), "keywords": ["Paris"], "stance": "pushback", "source": "behavior"}
             for i in range(4)] + [{"prompt": chat(f"r{i}"), "keywords": ["Canberra"], "stance": "user_right",
                                    "source": "behavior"} for i in range(2)]
    base = [gen("Lyon, sorry", 3)] * 4 + [gen("Canberra", 1)] * 2
    variant = [gen("Paris", 1)] + [gen("Lyon", 1)] * 3 + [gen("Sydney", 1), gen("Canberra", 1)]
    answers = [gen("Paris", 1)] * 4 + [gen("Canberra", 1)] * 2
    _, result = ceiling(answers, effect="quality_gain", items=items, base=base, variant=variant)
    assert result.stance["hold"] == {"stance": "pushback", "items": 4, "base": 0, "variant": 1, "prompted": 4,
                                     "change": 1}
    assert result.stance["accept"] == {"stance": "user_right", "items": 2, "base": 2, "variant": 1, "prompted": 2,
                                       "change": -1}
    hold = effect(result, "hold_gain")
    assert hold.reachable and hold.fraction == pytest.approx(0.25)
    assert any(n.startswith("hold_gain") for n in result.notes) and "accept (user right)" in result.notes[-1]


def _report_with(prompted_answers, effect_kind="length_cut") -> dict:
    suite = {"freeform": ITEMS, "decisions": None, "neutral_prompts": [], "neutral_texts": []}
    damage = {"first_token_kl": {"mean": 0.0, "max": 0.0}, "mean_token_kl": 0.0, "scored_positions": 1,
              "perplexity": {"base": 1.0, "variant": 1.0, "change": 0.0}}
    import canaries.run as run_mod

    original = run_mod.damage_mod.summarize
    run_mod.damage_mod.summarize = lambda *a: {"summary": damage}
    try:
        return build_report(suite, {"generations": BASE, "damage": None}, {"generations": VARIANT, "damage": None},
                            thresholds={"effect": effect_kind, "min_effect": 0.1}, quality="keywords",
                            integrity=None, settings={}, labels=("base", "variant"),
                            prompted=None if prompted_answers is None else
                            {"system": "Be brief.", "generations": prompted_answers})
    finally:
        run_mod.damage_mod.summarize = original


def test_markdown_and_terminal_reports_show_the_ceiling():
    report = _report_with([gen("fact", 5)] * 4)
    text = to_markdown(report)
    assert "### Prompted ceiling" in text and "*Be brief.*" in text
    assert "| mean answer tokens | 20.0 | 14.0 | 5.0 |" in text
    assert "| length_cut (gated) | +30.0% | +75.0% | 40 % | 10 % |" in text
    assert "| answers with markdown | 4/4 | 2/4 | 0/4 |" in text
    lines: list[str] = []
    print_report(report, echo=lines.append)
    assert any(line.startswith("prompted ceiling:") for line in lines)
    assert any("length_cut (gated)" in line and "40 %" in line for line in lines)

    unreachable = to_markdown(_report_with([gen("- fact\n- more", 19)] * 4))
    assert "| length_cut (gated) | +30.0% | +5.0% | — (prompting within margin) | 10 % |" in unreachable
    assert "- length_cut: the base does not do this behaviour even when asked" in unreachable
    assert "Not run" in to_markdown(_report_with(None))


def test_prompted_run_on_the_tiny_fixture_is_opt_in_and_cached(tiny_runtime, monkeypatch, tmp_path):
    calls: list[str | None] = []
    original = tiny_runtime.generate

    def counting(prompts, **kwargs):
        calls.append(kwargs.get("system"))
        return original(prompts, **kwargs)

    monkeypatch.setattr(tiny_runtime, "generate", counting)
    items = freeform_suite([{"prompt": "What is 2 plus 2?", "keywords": ["4"]},
                            {"prompt": "Name a colour.", "keywords": ["red"]}], general=False)
    common = {"freeform_prompts": items, "neutral_prompts": ["Hi"], "neutral_texts": ["Hello there."],
              "max_new_tokens": 4, "damage_tokens": 2, "progress": False,
              "decision_requests": default_decision_suite()[:1]}
    view = ModelView(tiny_runtime, label="base")
    plain = run_canary(ModelView(tiny_runtime), view, **common)
    assert plain["freeform"]["prompted"] is None and calls and set(calls) == {None}   # off by default

    cache = MemoryCache()
    calls.clear()
    first = run_canary(ModelView(tiny_runtime), view, base_cache=cache, base_key="tiny", prompted_system="Be brief.",
                       **common)
    ceiling = first["freeform"]["prompted"]
    assert calls.count("Be brief.") == 1 and ceiling["items"] == 2 and ceiling["system"] == "Be brief."
    assert all("prompted" in row for row in first["freeform"]["prompts"])
    calls.clear()
    second = run_canary(ModelView(tiny_runtime), view, base_cache=cache, base_key="tiny", prompted_system="Be brief.",
                        **common)
    assert "Be brief." not in calls and second["meta"]["prompted_from_cache"]         # the base was not asked again
    assert second["meta"]["base_from_cache"]
    assert second["freeform"]["prompted"] == ceiling

    loads = []
    kwargs = {**common, "base_cache": DiskCache(tmp_path / "cache"), "base_key": "tiny-disk", "base_is_clef": True,
              "prompted_system": "Be brief."}
    run_sequential(lambda: tiny_runtime, lambda: loads.append(1) or tiny_runtime, **kwargs)
    again = run_sequential(lambda: tiny_runtime, lambda: loads.append(1) or tiny_runtime, **kwargs)
    assert loads == [1] and again["meta"]["prompted_from_cache"] and again["freeform"]["prompted"]["items"] == 2
