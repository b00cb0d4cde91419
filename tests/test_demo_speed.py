"""The demo's cost, made visible and cut without changing a figure (issue 15 item 6, issue 11 "cost of the
search"): `blaze edit`'s per-stage timing, `Runtime.generate`'s counters, and the loop check's answers-only
canary (`run_freeform`), which must give the same answers as the free-form part of a full canary."""

from __future__ import annotations

import time

from test_canaries_run import tiny_patch

from canaries.cache import MemoryCache
from canaries.run import ModelView, freeform_suite, run_canary, run_freeform
from canaries.suites import default_decision_suite
from variants.timing import StageTimes


def test_stage_times_mark_consecutive_stages_and_a_total():
    times = StageTimes()
    time.sleep(0.02)
    first = times.mark("load")
    sum(i * i for i in range(200_000))          # some CPU work in the second stage
    second = times.mark("statistics")
    assert [s.name for s in times.stages] == ["load", "statistics"]
    assert first.wall_s >= 0.02 and first.cpu_s < first.wall_s   # sleeping is wall time, not CPU time
    assert second.cpu_s > 0
    total = times.total()
    assert total.wall_s >= first.wall_s + second.wall_s
    line = times.summary()
    assert line.startswith("timing: load ") and "; statistics " in line and "; total " in line and "cpu " in line
    assert set(times.to_dict()) == {"load", "statistics", "total"}


def test_generate_counts_answers_tokens_and_batch_steps(tiny_runtime):
    before = tiny_runtime.generation_stats
    answers, tokens, steps, calls = before.answers, before.new_tokens, before.steps, before.calls
    prompts = [item["prompt"] for item in freeform_suite()[:3]]
    gens = tiny_runtime.generate(prompts, max_new_tokens=5, batch_size=2)
    after = tiny_runtime.generation_stats
    assert after.calls == calls + 1 and after.answers == answers + 3
    assert after.new_tokens - tokens == sum(g.new_tokens for g in gens)
    # two batches (2 + 1 prompts); each runs until its longest answer stops: at most 5 steps, at least 1
    assert 2 <= after.steps - steps <= 10
    assert after.seconds > 0 and "generated" in after.text()


def test_run_freeform_gives_the_free_form_section_of_a_full_canary(tiny_runtime):
    """The loop check's answers-only run: the same answers and summary as `run_canary`'s free-form section
    (same prompts, tokens and batch size), the base's answers taken from the cache the second time."""
    patch = tiny_patch(tiny_runtime, relative=0.3)
    variant = ModelView(tiny_runtime, activate=lambda: patch.applied(tiny_runtime), label="variant")
    base = ModelView(tiny_runtime, label="base")
    prompts = freeform_suite()[:3]
    full = run_canary(variant, base, freeform_prompts=prompts, max_new_tokens=8, batch_size=2, progress=False,
                      neutral_prompts=[prompts[0]["prompt"]], neutral_texts=["A short neutral text."],
                      damage_tokens=4, decision_requests=default_decision_suite()[:1])["freeform"]
    cache = MemoryCache()
    only = run_freeform(variant, base, freeform_prompts=prompts, max_new_tokens=8, batch_size=2, base_cache=cache,
                        base_key="k")
    assert [r["variant"]["text"] for r in only["prompts"]] == [r["variant"]["text"] for r in full["prompts"]]
    assert [r["base"]["text"] for r in only["prompts"]] == [r["base"]["text"] for r in full["prompts"]]
    assert only["summary"] == full["summary"]
    assert any(r["base"]["text"] != r["variant"]["text"] for r in only["prompts"])   # the edit is visible
    answers = tiny_runtime.generation_stats.answers
    again = run_freeform(variant, base, freeform_prompts=prompts, max_new_tokens=8, batch_size=2, base_cache=cache,
                         base_key="k")
    assert tiny_runtime.generation_stats.answers == answers + 3          # the variant only: base from the cache
    assert again["summary"] == only["summary"]
