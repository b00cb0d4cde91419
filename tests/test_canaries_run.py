"""The whole canary on the tiny Clef fixture: in-process runs (shared runtime, edit toggled), caches, the CLI."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner
from test_canaries_support import WRITERS, low_rank_delta, make_variant

from canaries.cache import DiskCache, MemoryCache
from canaries.run import ModelView, freeform_suite, run_canary, run_sequential
from canaries.suites import default_decision_suite, general_prompts, neutral_prompts, neutral_texts

REPORT_KEYS = {"freeform", "damage", "decisions", "integrity", "gate"}


def small_suites():
    """A few items of every shipped suite (the model-card invoice and the image request included)."""
    requests = default_decision_suite()
    return dict(freeform_prompts=freeform_suite()[:3], damage_tokens=6,
                decision_requests=[requests[0], requests[3]],
                neutral_prompts=neutral_prompts()[:2], neutral_texts=neutral_texts()[:2])


def tiny_patch(runtime, relative: float):
    """A rank-1 edit of two writer matrices as a surgery Patch (how `blaze edit` sweeps toggle variants)."""
    from surgery.patch import Patch

    linears = runtime.named_linears()
    factors = {}
    for index, full in enumerate(WRITERS):
        name = full.removesuffix(".weight")
        delta = low_rank_delta(linears[name].weight.detach(), 1, relative, seed=index)
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        factors[name] = (u[:, :1] * s[:1], vh[:1].T)
    return Patch(factors)


def test_identical_models_show_no_damage_and_pass(tiny_runtime):
    base = ModelView(tiny_runtime, label="base")
    report = run_canary(ModelView(tiny_runtime), base, max_new_tokens=12, progress=False, **small_suites())
    assert set(report) >= REPORT_KEYS
    damage = report["damage"]["summary"]
    assert damage["first_token_kl"]["max"] < 1e-5 and damage["mean_token_kl"] < 1e-5
    assert damage["perplexity"]["base"] == pytest.approx(damage["perplexity"]["variant"], rel=1e-5)
    decisions = report["decisions"]["summary"]
    assert decisions["max_abs_delta"] < 1e-5 and decisions["argmax_flips"] == 0
    for row in report["freeform"]["prompts"]:
        assert row["base"]["text"] == row["variant"]["text"]
    assert report["gate"]["passed"], report["gate"]["failed"]


def test_edited_variant_full_default_suites(tiny_runtime):
    patch = tiny_patch(tiny_runtime, relative=0.3)
    linears = tiny_runtime.named_linears()
    before = {n: linears[n].weight.detach().clone() for n in patch.names()}
    variant = ModelView(tiny_runtime, activate=lambda: patch.applied(tiny_runtime, 1.0))
    cache = MemoryCache()
    started = time.process_time()  # CPU seconds of all threads: fair on a shared 2-core machine
    report = run_canary(variant, ModelView(tiny_runtime, label="base"), freeform_prompts=freeform_suite(),
                        max_new_tokens=16, damage_tokens=16, progress=False, base_cache=cache, base_key="tiny")
    cpu_seconds = time.process_time() - started
    json.loads(json.dumps(report))                                       # plain JSON data throughout
    assert set(report) >= REPORT_KEYS and cpu_seconds < 2 * 120           # 2 cores × 2 minutes
    for name, weight in before.items():                                   # the edit was toggled off again
        assert torch.equal(linears[name].weight, weight)

    free = report["freeform"]
    assert [row["prompt"] for row in free["prompts"]] == [p["prompt"] for p in general_prompts()]
    first = free["prompts"][0]
    assert first["prompt"] == "What is the speed of light?"
    assert first["base"]["tokens"] > 0 and first["base"]["words"] == len(first["base"]["text"].split())
    assert {"mean_tokens", "median_tokens", "loop_rate", "hit_limit_rate", "empty_rate", "quality"} <= set(free["summary"])

    damage = report["damage"]["summary"]
    assert damage["first_token_kl"]["mean"] > 1e-4 and damage["mean_token_kl"] > 1e-4
    assert damage["scored_positions"] >= len(neutral_prompts())
    assert damage["perplexity"]["base"] != damage["perplexity"]["variant"]

    decisions = report["decisions"]
    assert len(decisions["requests"]) == len(default_decision_suite())
    invoice = decisions["requests"][0]
    assert invoice["id"] == "model-card-invoice"
    assert invoice["lines"][0].startswith("status: picks ") and "(vanilla: " in invoice["lines"][0]
    assert invoice["lines"][1].startswith("large: p(true) ")
    probabilities = invoice["questions"]["status"]["variant"]["probabilities"]
    assert set(probabilities) == {"paid", "overdue", "draft"} and sum(probabilities.values()) == pytest.approx(1.0)
    assert any(r["image"] for r in decisions["requests"])
    assert decisions["summary"]["max_abs_delta"] > 0
    calibration = decisions["summary"]["calibration"]
    assert calibration["base"]["labelled_questions"] >= 10
    assert 0 <= calibration["variant"]["ece"] <= 1 and 0 <= calibration["variant"]["brier"] <= 2

    again = run_canary(variant, ModelView(tiny_runtime, label="base"), freeform_prompts=freeform_suite(),
                       max_new_tokens=16, damage_tokens=16, progress=False, base_cache=cache, base_key="tiny")
    assert again["meta"]["base_from_cache"] and not report["meta"]["base_from_cache"]
    assert again["damage"]["summary"] == report["damage"]["summary"]
    assert again["decisions"]["summary"] == report["decisions"]["summary"]


def test_sequential_run_caches_the_base_on_disk(tiny_release, tiny_runtime, tmp_path):
    variant_dir = make_variant(tiny_release, tmp_path / "variant", relative=0.1)
    from clef_model.runtime import Runtime

    loads = []

    def load_base():
        loads.append("base")
        return tiny_runtime

    def load_variant():
        return Runtime.load(str(variant_dir), device="cpu", dtype=torch.float32)

    kwargs = dict(max_new_tokens=6, progress=False, base_cache=DiskCache(tmp_path / "cache"), base_key="tiny-base",
                  base_is_clef=True, **small_suites())
    first = run_sequential(load_variant, load_base, **kwargs)
    second = run_sequential(load_variant, load_base, **kwargs)
    assert loads == ["base"]                                              # second run: base outputs from disk
    assert second["meta"]["base_from_cache"]
    assert second["damage"]["summary"] == first["damage"]["summary"]
    assert first["decisions"]["summary"]["max_abs_delta"] > 0


@pytest.fixture(scope="module")
def cli_variant(tiny_release, tmp_path_factory):
    return make_variant(tiny_release, tmp_path_factory.mktemp("cli") / "variant", relative=0.05)


@pytest.fixture(scope="module")
def small_suite_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("suites")
    suites = small_suites()
    chat = folder / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": p["prompt"], "keywords": p["keywords"]}) + "\n"
                            for p in suites["freeform_prompts"]))
    requests = folder / "requests.jsonl"
    requests.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "images"}) + "\n"
                                for r in suites["decision_requests"][:1]))
    return chat, requests


def invoke(*args):
    from variants.cli import main

    return CliRunner().invoke(main, ["canary", *map(str, args)], catch_exceptions=False)


def test_cli_passes_writes_json_and_markdown(tiny_release, cli_variant, small_suite_files, tmp_path):
    chat, requests = small_suite_files
    result = invoke(cli_variant, "--against", tiny_release, "--suite", chat, "--suite", requests,
                    "--max-new-tokens", 8, "--device", "cpu", "--damage-tokens", 4, "--json", tmp_path / "r.json",
                    "--markdown", tmp_path / "r.md", "--max-first-token-kl", 10, "--max-mean-token-kl", 10,
                    "--max-decision-drift", 1, "--max-argmax-flips", 100)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report) >= REPORT_KEYS
    assert report["integrity"]["passed"]
    assert {c["name"] for c in report["integrity"]["changed_tensors"]} == set(WRITERS)
    assert len(report["decisions"]["requests"]) == 1
    assert report["freeform"]["prompts"][0]["source"] == "behavior"
    markdown = (tmp_path / "r.md").read_text()
    assert "**Prompt:** What is the speed of light?" in markdown and "picks" in markdown
    assert "gate: PASSED" in result.output
    assert report["freeform"]["noise_floor"] is None and "Noise floor" not in result.output


def test_cli_noise_floor_reports_the_base_rerun(tiny_release, cli_variant, small_suite_files, tmp_path):
    chat, _requests = small_suite_files
    result = invoke(cli_variant, "--against", tiny_release, "--suite", chat, "--max-new-tokens", 6, "--device", "cpu",
                    "--damage-tokens", 4, "--json", tmp_path / "r.json", "--max-first-token-kl", 10,
                    "--max-mean-token-kl", 10, "--max-decision-drift", 1, "--max-argmax-flips", 100, "--noise-floor")
    assert result.exit_code == 0, result.output
    noise = json.loads((tmp_path / "r.json").read_text())["freeform"]["noise_floor"]
    assert noise["items"] == 3 and noise["answers_differ"] == 0           # float32 on the CPU: unbatched, same tokens
    assert "Noise floor (the base, one prompt per batch against batches of 128)" in result.output


def test_cli_bad_input_exits_2(tiny_release, cli_variant, tmp_path):
    missing = invoke(tmp_path / "nowhere", "--against", tiny_release)
    assert missing.exit_code == 2 and "error:" in missing.output
    bad_suite = tmp_path / "bad.jsonl"
    bad_suite.write_text("{oops\n")
    broken = invoke(cli_variant, "--against", tiny_release, "--suite", bad_suite)
    assert broken.exit_code == 2 and "not valid JSON" in broken.output
    usage = invoke(cli_variant, "--against", tiny_release, "--max-first-token-kl", "lots")
    assert usage.exit_code == 2


def test_cli_refuses_a_variant_of_another_base(tiny_release, tmp_path):
    from clef_model.fixtures import build_fixture

    other = build_fixture(tmp_path / "other", "tiny", num_layers=4, seed=5)
    result = invoke(other, "--against", tiny_release)
    assert result.exit_code == 2 and "not a variant of" in result.output


def test_cli_tight_threshold_and_altered_joint_head_fail_with_exit_1(tiny_release, tmp_path, small_suite_files):
    chat, requests = small_suite_files
    variant = make_variant(tiny_release, tmp_path / "variant", relative=0.05, alter_head=True)
    result = invoke(variant, "--against", tiny_release, "--suite", chat, "--suite", requests, "--max-new-tokens", 4,
                    "--device", "cpu", "--damage-tokens", 4, "--max-first-token-kl", 0, "--max-mean-token-kl", 10,
                    "--max-decision-drift", 1, "--max-argmax-flips", 100)
    assert result.exit_code == 1, result.output
    assert "FAIL] first_token_kl" in result.output                      # the tightened threshold
    assert "joint head (joint_head.safetensors) differs" in result.output  # and integrity
    assert "gate: FAILED (first_token_kl, integrity)" in result.output


def test_a_decision_state_cut_to_the_token_limit_is_in_the_report(tiny_runtime, monkeypatch):
    """Runtime.warnings of the canary's runs (here a state cut to the input cap) reach the JSON and markdown."""
    from functools import partial

    from canaries.report import to_markdown

    capped = partial(type(tiny_runtime).decision_probabilities, tiny_runtime, max_length=512)  # a cap a test can fill
    monkeypatch.setattr(tiny_runtime, "decision_probabilities", capped)
    suites = small_suites()
    first = suites["decision_requests"][0]
    suites["decision_requests"] = [first, {**first, "id": "long-state", "state": {"notes": "word " * 2000}}]
    base, variant = ModelView(tiny_runtime, label="base"), ModelView(tiny_runtime, label="variant")
    report = json.loads(json.dumps(run_canary(variant, base, max_new_tokens=4, progress=False, **suites)))
    assert len(report["warnings"]) == 1, report["warnings"]  # base and variant cut it alike: said once
    assert report["warnings"][0].startswith("request 1: its state is") and "only the first" in report["warnings"][0]
    markdown = to_markdown(report)
    assert "### Warnings" in markdown and "request 1: its state is" in markdown
    suites["decision_requests"] = [first]
    clean = run_canary(variant, base, max_new_tokens=4, progress=False, **suites)
    assert clean["warnings"] == [] and "### Warnings" not in to_markdown(clean)
