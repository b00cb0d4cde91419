"""`canaries.noise`: the base's free-form answers again one prompt per batch, and what moved with no edit."""

from __future__ import annotations

import json

import pytest
from test_canaries_run import small_suites

from canaries.cache import DiskCache
from canaries.noise import NOISE_BATCH, summarize_noise
from canaries.report import noise_sentence, to_markdown
from canaries.run import ModelView, run_canary, run_sequential


def gen(ids: list[int], text: str = "x", hit_limit: bool = False) -> dict:
    return {"text": text, "new_tokens": len(ids), "token_ids": ids, "hit_limit": hit_limit}


def test_summary_counts_what_moved_between_two_runs_of_one_model():
    items = [{"prompt": "a", "keywords": ["paris"]}, {"prompt": "b", "keywords": ["rome"]}, {"prompt": "c"},
             {"prompt": "d"}]
    loop = [7] * 14                                                     # one token 14 times: a loop
    first = [gen([1, 2], "Paris."), gen([3], "Rome."), gen(loop, hit_limit=True), gen([5, 6])]
    again = [gen([1, 2], "Paris."), gen([4], "Milan."), gen([8, 9]), gen(loop, hit_limit=True)]
    noise = summarize_noise(items, first, again, "one prompt per batch against batches of 16")
    assert (noise.items, noise.answers_differ, noise.keyword_flips) == (4, 3, 1)
    assert (noise.loops_new, noise.loops_gone, noise.limit_new, noise.limit_gone) == (1, 1, 1, 1)
    same = summarize_noise(items, first, first, "p")
    assert same.answers_differ == same.loops_new == same.keyword_flips == 0


def test_canary_reports_the_noise_floor_beside_the_edit_and_caches_it(tiny_runtime, tmp_path, monkeypatch):
    """Opt-in: the base reruns one prompt per batch; the report carries the counts and a sentence; the gate is
    the same as without it; a second run reads the rerun from the cache."""
    calls: list[int] = []
    original = type(tiny_runtime).generate

    def counting(self, prompts, **kwargs):
        calls.append(kwargs.get("batch_size", 8))
        return original(self, prompts, **kwargs)

    monkeypatch.setattr(type(tiny_runtime), "generate", counting)
    suites = small_suites()
    base = ModelView(tiny_runtime, label="base")
    cache = DiskCache(tmp_path / "cache")
    plain = run_canary(ModelView(tiny_runtime), base, max_new_tokens=8, progress=False, batch_size=4, **suites)
    assert plain["freeform"]["noise_floor"] is None and noise_sentence(plain) is None
    calls.clear()
    report = run_canary(ModelView(tiny_runtime), base, max_new_tokens=8, progress=False, batch_size=4,
                        base_cache=cache, base_key="tiny", noise_floor=True, **suites)
    assert NOISE_BATCH in calls                                          # the unbatched rerun of the base
    noise = report["freeform"]["noise_floor"]
    assert noise["items"] == len(suites["freeform_prompts"]) and noise["path"].endswith("batches of 4")
    # float32 on the CPU: the same tokens unbatched (the floor this measures is bfloat16's)
    assert noise["answers_differ"] == 0 and noise["loops_new"] == 0
    assert report["gate"] == plain["gate"]
    assert "Noise floor (the base, one prompt per batch against batches of 4)" in to_markdown(report)
    assert report["meta"]["seconds"]["noise_floor"] is not None
    json.dumps(report)
    calls.clear()
    again = run_canary(ModelView(tiny_runtime), base, max_new_tokens=8, progress=False, batch_size=4,
                       base_cache=cache, base_key="tiny", noise_floor=True, **suites)
    assert NOISE_BATCH not in calls and again["freeform"]["noise_floor"] == noise   # from the disk cache


@pytest.mark.parametrize("cached", [False, True])
def test_sequential_canary_loads_the_base_only_when_the_rerun_is_missing(tiny_runtime, tmp_path, cached):
    loads: list[str] = []

    def load_base():
        loads.append("base")
        return tiny_runtime

    kwargs = dict(max_new_tokens=6, progress=False, base_cache=DiskCache(tmp_path / "cache"), base_key="tiny",
                  base_is_clef=True, batch_size=4, **small_suites())
    run_sequential(lambda: tiny_runtime, load_base, **kwargs)          # base answers cached, no noise run
    assert loads == ["base"]
    if cached:
        run_sequential(lambda: tiny_runtime, load_base, noise_floor=True, **kwargs)
    loads.clear()
    report = run_sequential(lambda: tiny_runtime, load_base, noise_floor=True, **kwargs)
    assert report["freeform"]["noise_floor"]["items"] == len(kwargs["freeform_prompts"])
    assert loads == ([] if cached else ["base"])
