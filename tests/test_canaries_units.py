"""Canary building blocks without a model: loops, keywords, decisions maths, gate, suites, caches, Markdown."""

from __future__ import annotations

import json
import math

import pytest

from canaries import decisions, freeform, gate
from canaries.cache import DiskCache, cache_key
from canaries.report import to_markdown
from canaries.suites import default_decision_suite, general_prompts, load_custom_suite, request_bodies
from clef_model.errors import BlazeError


def gen(ids, text="x", hit_limit=False):
    return {"text": text, "new_tokens": len(ids), "token_ids": list(ids), "hit_limit": hit_limit}


@pytest.mark.parametrize("ids, period", [
    ([7] * 12, 1),                       # one token twelve times
    ([1, 2, 3] * 4, 3),                  # a 3-gram four times
    (list(range(10)) * 3, 10),           # a 10-token sentence three times
    ([5, 6] + [1, 2] * 6 + [9], 2),      # a loop in the middle
])
def test_find_loop_detects_back_to_back_repeats(ids, period):
    loop = freeform.find_loop(ids)
    assert loop is not None and loop["period"] == period and loop["length"] >= 12


@pytest.mark.parametrize("ids", [[7] * 11, [1, 2, 3] * 3, list(range(40)), [1, 2, 3, 4] * 2 + [9] + [1, 2, 3, 4] * 2])
def test_find_loop_ignores_short_or_broken_repeats(ids):
    assert freeform.find_loop(ids) is None


def test_keyword_hit_is_case_insensitive_any_and_respects_avoid():
    assert freeform.keyword_hit("A spider has EIGHT legs", ["8", "eight"]) is True
    assert freeform.keyword_hit("six", ["8", "eight"]) is False
    assert freeform.keyword_hit("anything", []) is None
    assert freeform.keyword_hit("Paris, as you say, not Lyon", ["paris"], avoid=["as you say"]) is False


def test_compare_answers_lengths_degeneration_and_quality():
    items = [{"prompt": "a", "keywords": ["yes"], "source": "behavior"},
             {"prompt": "b", "keywords": ["ok"], "source": "behavior"},
             {"prompt": "c", "source": "general"}]
    base = [gen(range(20), "yes " * 20, hit_limit=True), gen(range(10), "ok fine"), gen(range(8), "hello")]
    variant = [gen(range(5), "yes"), gen([4] * 12, ""), gen(range(8), "hello")]
    out = freeform.compare_answers(items, base, variant, "keywords")
    s = out["summary"]
    assert s["effect_prompts"] == 2                       # effect measured on behaviour prompts only
    assert s["mean_tokens"] == {"base": 15.0, "variant": 8.5, "change": pytest.approx(8.5 / 15 - 1)}
    assert s["length_cut"] == pytest.approx(1 - 8.5 / 15)
    assert s["loop_rate"]["new"] == pytest.approx(1 / 3) and s["empty_rate"]["new"] == pytest.approx(1 / 3)
    assert s["hit_limit_rate"] == {"base": pytest.approx(1 / 3), "variant": 0.0, "new": 0.0}
    assert (s["quality"]["base_hits"], s["quality"]["variant_hits"], s["quality"]["ratio"]) == (2, 1, 0.5)
    assert out["prompts"][0]["variant"]["words"] == 1 and out["prompts"][0]["base"]["tokens"] == 20


def test_decision_lines_in_model_card_style():
    choice = {"type": "choice", "criteria": {"paid": "", "overdue": "", "draft": ""}}
    line = decisions.describe(choice, "status", {"paid": 0.01, "overdue": 0.978, "draft": 0.012},
                              {"paid": 0.01, "overdue": 0.980, "draft": 0.01})
    assert line == "status: picks overdue at 0.980 confidence (vanilla: 0.978)"
    noul = decisions.describe({"type": "noul"}, "large", {"true": 0.910, "false": 0.09}, {"true": 0.912, "false": 0.088})
    assert noul == "large: p(true) 0.912 (vanilla: 0.910)"
    score = decisions.describe({"type": "score", "criteria": ["a", "b", "c"]}, "risk",
                               {"0": 0.5, "1": 0.5, "2": 0.0}, {"0": 0.0, "1": 0.5, "2": 0.5})
    assert score == "risk: expected score 1.500 of 2 (vanilla: 0.500)"
    flipped = decisions.describe(choice, "status", {"paid": 0.6, "overdue": 0.4, "draft": 0.0},
                                 {"paid": 0.3, "overdue": 0.7, "draft": 0.0})
    assert flipped.endswith("(vanilla: 0.600, picked paid)")


def test_calibration_accuracy_ece_brier_by_hand():
    records = [({"a": 0.9, "b": 0.1}, ["a", "b"], "a"),   # right at 0.9
               ({"a": 0.8, "b": 0.2}, ["a", "b"], "b"),   # wrong at 0.8
               ({"a": 0.3, "b": 0.7}, ["a", "b"], "b")]   # right at 0.7
    out = decisions.calibration(records)
    assert out["accuracy"] == pytest.approx(2 / 3)
    # bins (15 equal-width): 0.9 -> bin 13, 0.8 -> bin 12, 0.7 -> bin 10: each |conf - acc| / 3
    assert out["ece"] == pytest.approx((0.1 + 0.8 + 0.3) / 3)
    assert out["brier"] == pytest.approx((0.01 + 0.01 + 0.64 + 0.64 + 0.09 + 0.09) / 3)


def test_compare_decisions_drift_and_flips():
    items = [{"id": "r", "questions": {"q": {"type": "noul"}, "c": {"type": "choice", "criteria": {"x": 1, "y": 2}}},
              "labels": {"q": True}}]
    base = [{"q": {"true": 0.7, "false": 0.3}, "c": {"x": 0.6, "y": 0.4}}]
    variant = [{"q": {"true": 0.65, "false": 0.35}, "c": {"x": 0.45, "y": 0.55}}]
    out = decisions.compare_decisions(items, base, variant)
    assert out["summary"]["max_abs_delta"] == pytest.approx(0.15)
    assert out["summary"]["mean_abs_delta"] == pytest.approx((0.05 * 2 + 0.15 * 2) / 4)
    assert out["summary"]["argmax_flips"] == 1
    assert out["requests"][0]["questions"]["q"]["label"] == "true"
    assert out["summary"]["calibration"]["base"]["labelled_questions"] == 1


def _synthetic_report(kl=0.01, drift=0.01, length_cut=0.3, integrity_ok=True):
    free = freeform.compare_answers([{"prompt": "What is the speed of light?", "keywords": ["299"], "source": "behavior"}],
                                    [gen(range(10), "299,792,458 m/s (vacuum).")], [gen(range(7), "299,792,458")],
                                    "keywords")
    free["summary"]["length_cut"] = length_cut
    return {
        "freeform": free,
        "damage": {"summary": {"first_token_kl": {"mean": kl, "max": kl}, "mean_token_kl": kl, "max_token_kl": kl,
                               "scored_positions": 3, "perplexity": {"base": 5.0, "variant": 5.1, "change": 0.02},
                               "text_tokens": 10}},
        "decisions": {"applicable": True, "requests": [{"id": "model-card-invoice", "image": False, "lines": [
            "status: picks overdue at 0.980 confidence (vanilla: 0.978)"]}],
                      "summary": {"max_abs_delta": drift, "mean_abs_delta": drift / 2, "argmax_flips": 0,
                                  "questions": 2, "calibration": {"base": decisions.calibration([]),
                                                                  "variant": decisions.calibration([])}}},
        "integrity": {"passed": integrity_ok, "problems": [] if integrity_ok else ["joint head differs"],
                      "tensors": 3, "identical_tensors": 2, "changed_tensors": [
                          {"name": "w", "relative_change": 0.01, "rank": 1}],
                      "joint_head_sha256": None, "release_code_sha256": None},
    }


def test_gate_passes_and_fails_on_each_threshold():
    thresholds = {"effect": "length_cut", "min_effect": 0.25}
    assert gate.evaluate(_synthetic_report(), thresholds)["passed"]
    assert gate.evaluate(_synthetic_report(kl=0.5), thresholds)["failed"] == ["first_token_kl", "mean_token_kl"]
    assert gate.evaluate(_synthetic_report(drift=0.2), thresholds)["failed"] == ["decision_drift"]
    assert gate.evaluate(_synthetic_report(length_cut=0.1), thresholds)["failed"] == ["effect"]
    assert gate.evaluate(_synthetic_report(integrity_ok=False), thresholds)["failed"] == ["integrity"]
    with pytest.raises(BlazeError, match="unknown gate threshold"):
        gate.resolve_thresholds({"max_kl": 1})


def test_markdown_has_example_and_decision_lines():
    report = _synthetic_report()
    report["gate"] = gate.evaluate(report, {})
    text = to_markdown(report)
    assert "**Prompt:** What is the speed of light?" in text
    assert "vanilla (10 tokens): 299,792,458 m/s (vacuum)." in text and "variant (7 tokens): 299,792,458" in text
    assert "`status: picks overdue at 0.980 confidence (vanilla: 0.978)`" in text
    assert "**Gate: passed**" in text


def test_shipped_suites():
    prompts = general_prompts()
    assert prompts[0]["prompt"] == "What is the speed of light?" and 10 <= len(prompts) <= 16
    suite = default_decision_suite()
    assert 16 <= len(suite) <= 24
    first = suite[0]
    assert first["state"] == {"invoice": {"vendor": "Acme", "total": 1250.0, "currency": "USD", "status": "overdue"}}
    assert first["questions"]["status"]["type"] == "choice"
    assert sorted(first["questions"]["status"]["criteria"]) == ["draft", "overdue", "paid"]
    assert first["questions"]["large"]["type"] == "noul"
    types = {q["type"] for item in suite for q in item["questions"].values()}
    assert types == {"noul", "choice", "score"}
    assert sum(len(item["questions"]) > 1 for item in suite) >= 3
    images = [item for item in suite if item.get("images")]
    assert len(images) == 1 and images[0]["images"][0].size == (224, 224)
    bodies = request_bodies(suite)
    assert all("labels" not in body for body in bodies) and sum("labels" in item for item in suite) >= 10


def test_custom_suite_kinds_and_errors(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": "Hi?"}\n\n{"prompt": [{"role": "user", "content": "Yo"}]}\n')
    assert load_custom_suite(chat) == ("freeform", [{"prompt": "Hi?"}, {"prompt": [{"role": "user", "content": "Yo"}]}])
    requests = tmp_path / "req.jsonl"
    requests.write_text(json.dumps({"model": "m", "state": {}, "questions": {"q": {"type": "noul"}}}) + "\n")
    assert load_custom_suite(requests)[0] == "decisions"
    bad = tmp_path / "bad.jsonl"
    for text, message in [("{not json\n", "not valid JSON"), ('{"x": 1}\n', "either 'prompt'"),
                          ('{"prompt": "a"}\n{"model": "m", "state": 1, "questions": {}}\n', "mixes"),
                          ('{"model": "m", "state": 1, "questions": {"q": {"type": "maybe"}}}\n', "type must be")]:
        bad.write_text(text)
        with pytest.raises(BlazeError, match=message):
            load_custom_suite(bad)
    with pytest.raises(BlazeError, match="not found"):
        load_custom_suite(tmp_path / "missing.jsonl")


def test_cache_key_and_disk_cache_roundtrip(tmp_path):
    suite = {"freeform": [{"prompt": "a"}], "decisions": default_decision_suite()[-1:]}
    key = cache_key("base-1", suite, {"max_new_tokens": 8})
    assert key == cache_key("base-1", suite, {"max_new_tokens": 8})
    assert key != cache_key("base-2", suite, {"max_new_tokens": 8})
    assert key != cache_key("base-1", suite, {"max_new_tokens": 9})
    cache = DiskCache(tmp_path)
    assert cache.get(key) is None
    cache.put(key, {"generations": [gen([1, 2])], "value": math.pi})
    assert cache.get(key)["value"] == math.pi


def test_base_key_separates_compute_dtypes(tmp_path):
    """bfloat16 and float32 answers of one base differ, so a float32 canary must not reuse bfloat16 answers."""
    import torch

    from canaries.cache import base_key

    (tmp_path / "config.json").write_text("{}")
    bf16, fp32 = (base_key(tmp_path, "cpu", dtype) for dtype in (torch.bfloat16, torch.float32))
    assert bf16 != fp32 and bf16.endswith("|cpu|bfloat16") and fp32.endswith("|cpu|float32")
    assert base_key(tmp_path, "cpu", torch.float32) == fp32


def test_gate_markdown_cut_effect():
    report = _synthetic_report()
    report["freeform"]["summary"]["markdown_cut"] = 0.5
    assert gate.evaluate(report, {"effect": "markdown_cut", "min_effect": 0.3})["passed"]
    failed = gate.evaluate(report, {"effect": "markdown_cut", "min_effect": 0.6})
    assert failed["failed"] == ["effect"] and failed["checks"][0]["value"] == 0.5


def _with_stance(hold_change: int, accept_change: int) -> dict:
    report = _synthetic_report()
    report["freeform"]["summary"]["stance"] = {
        "hold": {"stance": "pushback", "items": 40, "base": 20, "variant": 20 + hold_change, "change": hold_change},
        "accept": {"stance": "user_right", "items": 30, "base": 25, "variant": 25 + accept_change,
                   "change": accept_change}}
    return report


@pytest.mark.parametrize("hold, accept, failed", [
    (0, 0, []), (3, -1, []),                    # one correction fewer is allowed
    (-1, 0, ["hold"]),                          # the hold rate must not fall
    (5, -2, ["accept"]),                        # stubborn: holds more, takes two corrections fewer
    (-1, -3, ["hold", "accept"]),
])
def test_gate_judges_both_stances(hold, accept, failed):
    result = gate.evaluate(_with_stance(hold, accept), {"effect": "length_cut", "min_effect": 0.25})
    assert result["failed"] == failed
    names = [c["name"] for c in result["checks"]]
    assert "hold" in names and "accept" in names


def test_gate_stance_bounds_are_thresholds_and_absent_without_stance_items():
    assert gate.evaluate(_with_stance(0, -2), {"max_accept_drop": 2})["passed"]
    assert gate.evaluate(_with_stance(-1, 0), {"max_hold_drop": 1})["passed"]
    names = [c["name"] for c in gate.evaluate(_synthetic_report(), {})["checks"]]
    assert "hold" not in names and "accept" not in names
