"""Model card: rendered from a variant folder's manifest and canary report; no invented numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from canaries.integrity import REPORT_MANIFEST_KEY
from clef_model.checkpoint import CheckpointReader, sha256_file
from clef_model.runtime import Generation
from variants.card import CARD_MARKER, base_hub_id, license_from_text, render_card, split_front_matter, write_card

VANILLA_ANSWER = "The speed of light in a vacuum is 299,792,458 metres per second (vacuum)."
VARIANT_ANSWER = "299,792,458 m/s."


def _generation(text: str, tokens: int) -> Generation:
    return Generation(text=text, prompt_tokens=12, new_tokens=tokens, token_ids=list(range(tokens)), hit_limit=False)


def canary_report(*, gate_passes: bool = True, integrity: dict[str, Any] | None = None,
                  clef: bool = True) -> dict[str, Any]:
    """A canary report assembled by the canaries package's own code from made-up model outputs
    (`integrity`: a real `check_integrity` result, or None when not run, as inside `blaze edit`)."""
    from canaries.decisions import compare_decisions, not_applicable
    from canaries.gate import evaluate
    from canaries.run import CanarySuite, build_report
    from canaries.suites import default_decision_suite

    freeform = [{"prompt": "What is the speed of light?", "keywords": ["299"], "source": "general"},
                {"prompt": "What is the capital of France?", "keywords": ["Paris"], "source": "behavior"}]
    base_gens = [_generation(VANILLA_ANSWER, 20), _generation("The capital of France is Paris, a large city.", 12)]
    variant_gens = [_generation(VARIANT_ANSWER, 6), _generation("Paris.", 2)]
    damage_ref = {"continuations": ["Hello there."], "text_sequences": [[1, 2, 3, 4]], "text_nll": [3.0]}
    damage_cmp = {"kl": [[0.01, 0.02]], "text_nll": [3.1]}
    thresholds = {"effect": "length_cut", "min_effect": 0.25 if gate_passes else 0.99}
    suite = CanarySuite(freeform=freeform, decisions=None, neutral_prompts=["Say hello."], neutral_texts=["x"])
    report = build_report(suite, {"generations": base_gens, "damage": damage_ref},
                          {"generations": variant_gens, "damage": damage_cmp},
                          thresholds=thresholds, quality="keywords",
                          integrity=integrity, settings={}, labels=("base", "variant"))
    if clef:
        request = default_decision_suite()[0]
        base_p = [{"status": {"paid": 0.011, "overdue": 0.978, "draft": 0.011}, "large": {"true": 0.91, "false": 0.09}}]
        var_p = [{"status": {"paid": 0.010, "overdue": 0.980, "draft": 0.010}, "large": {"true": 0.912, "false": 0.088}}]
        report["decisions"] = compare_decisions([request], base_p, var_p)
    else:
        report["decisions"] = not_applicable()
    report["gate"] = evaluate(report, thresholds)  # again, now with the decisions section
    return report


def make_variant(base: Path, out: Path, *, canary: str | None = "after", gate_passes: bool = True,
                 integrity_passes: bool = True, clef: bool = True, base_ref: str | None = None) -> Path:
    """A real variant of `base` written by `surgery.write.write_variant` (rank-1 edit of one down_proj).

    `canary`: "after" writes a canary report with a real `check_integrity` result next to the finished
    folder (as `blaze canary --json` does); "edit" stores a report without integrity through
    `extra_files`, listed in the manifest (as `blaze edit` does); None writes no report. The report's
    model outputs are made up (see `canary_report`). `base_ref` overrides the manifest's base reference.
    """
    from canaries.integrity import check_integrity
    from clef_model.release import resolve_release
    from surgery.patch import Patch, base_identity
    from surgery.write import write_variant

    release = resolve_release(str(base))
    reader = CheckpointReader(base)
    name = next(n for n in reader.names() if n.endswith("mlp.down_proj.weight"))[: -len(".weight")]
    d_out, d_in = reader.shape(name + ".weight")
    generator = torch.Generator().manual_seed(0)
    u, v = torch.randn(d_out, 1, generator=generator) * 0.05, torch.randn(d_in, 1, generator=generator) * 0.05
    patch = Patch({name: (u, v)}, base_identity=base_identity(release, [name]), metadata={"behavior": "verbosity"})
    from variants.spec import load_behavior

    edit = {"behavior": "verbosity", "spec_hash": load_behavior("verbosity").spec_hash, "method": "steer", "kinds": ["writers"],
            "layers": [0], "rank": 1, "strength": 0.15, "lambda": 1.0, "strength_mode": "fixed", "sweep": []}
    extra = ({"blaze_canary.json": json.dumps(canary_report(gate_passes=gate_passes, integrity=None, clef=clef)).encode()}
             if canary == "edit" else None)
    write_variant(release, patch, out, manifest_extra=edit, progress=False, extra_files=extra)
    if not clef:
        for side in ("joint_head.safetensors", "joint_head_config.json", "joint_schema_model.py"):
            (out / side).unlink()
    manifest_path = out / "blaze_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if not clef:
        for side in ("joint_head.safetensors", "joint_head_config.json", "joint_schema_model.py"):
            manifest["output"]["files"].pop(side)
    if base_ref is not None:
        manifest["base"]["ref"] = base_ref
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    if canary == "after":
        integrity = check_integrity(out, base) if clef else None
        if integrity is not None and not integrity_passes:
            integrity = {**integrity, "passed": False, "problems": ["joint head differs from the base"]}
        report = canary_report(gate_passes=gate_passes, integrity=integrity, clef=clef)
        # as `blaze canary` does: the report names the weights it ran on by their manifest's SHA-256
        report.setdefault("meta", {})[REPORT_MANIFEST_KEY] = sha256_file(manifest_path)
        (out / "blaze_canary.json").write_text(json.dumps(report, indent=1))
    return out


@pytest.fixture()
def variant(tiny_release: Path, tmp_path: Path) -> Path:
    return make_variant(tiny_release, tmp_path / "variant", base_ref="Cloudflare/clef-flash")


def test_front_matter(variant: Path):
    meta, body = split_front_matter(render_card(variant, "you/clef-flash-concise"))
    assert meta["base_model"] == "Cloudflare/clef-flash"
    assert meta["base_model_relation"] == "finetune"
    assert meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers"
    assert meta["tags"] == ["blaze", "clef", "verbosity", "model-editing"]
    assert meta["pipeline_tag"] == "image-text-to-text"
    assert body.lstrip().startswith("# you/clef-flash-concise")


def test_card_reports_measured_shift_and_decisions(variant: Path):
    card = render_card(variant, "you/clef-flash-concise")
    assert f'Vanilla base: "{VANILLA_ANSWER}"' in card
    assert f'This variant: "{VARIANT_ANSWER}"' in card
    assert "`status: picks overdue at 0.980 confidence (vanilla: 0.978)`" in card
    assert "`large: p(true) 0.912 (vanilla: 0.910)`" in card
    assert "argmax flips 0" in card and "Typed-decision inference intact" in card
    assert "Canary gate: passed" in card
    assert "Full canary report" in card and "### Integrity" in card  # canaries.report.to_markdown, reused


def test_card_says_how_it_was_made_and_how_to_use_it(variant: Path):
    card = render_card(variant, "you/clef-flash-concise")
    for fact in ("Method: steer", "Rank per matrix (k): 1", "Strength (α): 0.15", "λ (preservation weight): 1",
                 "Target kinds: writers", "Edited matrices: 1", "no training data"):
        assert fact in card, fact
    assert 'load_release_model(path, device="cuda")' in card and "systemone(" in card
    assert "enable_thinking=False" in card and 'snapshot_download("you/clef-flash-concise")' in card
    assert "cross-prompt effects" in card
    assert "License: apache-2.0, inherited from the base model" in card
    assert "Question tokens preserved" not in card           # the fixture's edit did not preserve them


def test_card_says_when_question_tokens_were_preserved(variant: Path):
    manifest_path = variant / "blaze_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["edit"]["questions"] = "preserve"
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    assert "Question tokens preserved" in render_card(variant, "you/clef-flash-concise")


def test_behaviour_description_only_for_the_same_spec(variant: Path):
    from variants.spec import load_behavior

    spec = load_behavior("verbosity")
    assert f"Behaviour: **verbosity** — {spec.description.rstrip('.')}." in render_card(variant)
    manifest = json.loads((variant / "blaze_manifest.json").read_text())
    manifest["edit"]["spec_hash"] = "0" * 64  # made from another version of the spec
    (variant / "blaze_manifest.json").write_text(json.dumps(manifest))
    card = render_card(variant)
    assert "Behaviour: **verbosity**." in card and spec.description not in card


def test_sweep_table(variant: Path):
    manifest = json.loads((variant / "blaze_manifest.json").read_text())
    manifest["edit"]["sweep"] = [
        {"strength": 0.1, "passed": True, "failed": [], "effect": 0.31, "first_token_kl": 0.02},
        {"strength": 0.15, "passed": True, "failed": [], "effect": 0.45, "first_token_kl": 0.05},
        {"strength": 0.2, "passed": False, "failed": ["loops"], "effect": 0.6, "first_token_kl": 0.09},
    ]
    (variant / "blaze_manifest.json").write_text(json.dumps(manifest))
    card = render_card(variant)
    assert "| strength | gate | effect | first_token_kl |" in card
    assert "| 0.15 (chosen) | pass | 0.45 | 0.05 |" in card
    assert "| 0.2 | fail: loops | 0.6 | 0.09 |" in card


def test_card_integrity_hashes_match_files(variant: Path):
    card = render_card(variant)
    for name in ("joint_head.safetensors", "joint_schema_model.py", "blaze_delta.safetensors"):
        assert f"`{name}`" in card and sha256_file(variant / name) in card


def test_missing_canary_report_invents_nothing(tiny_release: Path, tmp_path: Path):
    folder = make_variant(tiny_release, tmp_path / "v", canary=None)
    card = render_card(folder)
    assert "free-form canary was not run" in card
    assert "typed-decision canary was not run" in card
    assert "confidence (vanilla" not in card and "Vanilla base:" not in card and "Canary gate" not in card


def test_plain_causal_lm_card(tiny_release: Path, tmp_path: Path):
    folder = make_variant(tiny_release, tmp_path / "v", clef=False, base_ref="smollm2")
    meta, body = split_front_matter(render_card(folder, "you/smol-concise"))
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["pipeline_tag"] == "text-generation" and "clef" not in meta["tags"]
    assert "typed-decision canary does not apply" in body
    assert "load_release_model" not in body and "AutoModelForCausalLM" in body


def test_local_base_has_no_base_model_field(tiny_release: Path, tmp_path: Path):
    folder = make_variant(tiny_release, tmp_path / "v")
    meta, body = split_front_matter(render_card(folder))
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert f"A behaviour variant of `{tiny_release.name}`" in body
    assert str(tiny_release.parent) not in body  # no local paths on a public card
    assert base_hub_id("Cloudflare/clef-flash") == "Cloudflare/clef-flash" and base_hub_id(None) is None


def test_license_inherited_from_base_card(variant: Path):
    (variant / "README.md").write_text("---\nlicense: mit\npipeline_tag: any-to-any\n---\n# Base card\n")
    meta, _ = split_front_matter(render_card(variant))
    assert meta["license"] == "mit" and meta["pipeline_tag"] == "any-to-any"
    assert license_from_text("Apache License\nVersion 2.0, January 2004") == "apache-2.0"
    assert license_from_text("MIT License\n\nPermission is hereby granted, free of charge") == "mit"
    assert license_from_text("All rights reserved.") is None


def test_write_card_is_atomic_and_stable(variant: Path):
    path = write_card(variant, "you/clef-flash-concise")
    text = path.read_text()
    assert CARD_MARKER in text and yaml.safe_load(text.split("---")[1])["license"] == "apache-2.0"
    assert not [p for p in variant.iterdir() if p.name.startswith(".README")]
    assert write_card(variant, "you/clef-flash-concise").read_text() == text  # re-render from its own card


def test_usage_snippets_run_on_the_tiny_release(variant: Path, tiny_release: Path, capsys):
    """Both code blocks of the card run as printed, with the repo id pointed at a local copy, on CPU."""
    import re

    card = render_card(variant, "you/clef-flash-concise")
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    assert len(blocks) == 2
    local = {"snapshot_download(\"you/clef-flash-concise\")": f"{str(variant)!r}",
             '"you/clef-flash-concise"': repr(str(variant)), 'device="cuda"': 'device="cpu"',
             "max_new_tokens=128": "max_new_tokens=4"}
    for block in blocks:
        for old, new in local.items():
            block = block.replace(old, new)
        exec(compile(block, "<card>", "exec"), {})  # noqa: S102 - our own rendered snippet
    printed = capsys.readouterr().out
    assert "'status'" in printed and "overdue" in printed  # systemone answered the card's request


def test_search_table_and_passes_in_the_card(variant: Path):
    """The adaptive search's rows (settings, verdict, reason, figures) and its passes reach the card."""
    manifest = json.loads((variant / "blaze_manifest.json").read_text())
    rows = [{"strength": 0.4, "method": "steer", "lam": 1.0, "stage": "strength", "passed": True, "failed": [],
             "reason": "pass", "effect": 0.3},
            {"strength": 0.8, "method": "steer", "lam": 1.0, "stage": "strength", "passed": False,
             "failed": ["quality"], "reason": "damage: quality", "effect": 0.5}]
    manifest["edit"].update(sweep=rows, strength=0.4, search={"budget": 8, "passes": 3, "stopped": "bracketed",
                                                               "chosen": {"strength": 0.4}, "rows": rows})
    (variant / "blaze_manifest.json").write_text(json.dumps(manifest))
    card = render_card(variant)
    assert "search of 2 points (3 of 8 generation passes; bracketed)" in card
    assert "| 0.4 (chosen) | pass | steer | 1 | strength | pass | 0.3 |" in card
    assert "| 0.8 | fail: quality | steer | 1 | strength | damage: quality | 0.5 |" in card


def test_a_variant_with_no_measured_effect_is_called_so(variant: Path, tmp_path: Path):
    """A gate with a minimum effect of 0 (sycophancy's) passes a variant that answers as its base does; the card
    says that plainly instead of letting "passed" suggest a working edit."""
    import shutil

    from canaries.gate import evaluate
    from canaries.run import CanarySuite, build_report
    from clef_model.files import CANARY_JSON
    from variants.card import no_measured_effect

    assert no_measured_effect(json.loads((variant / CANARY_JSON).read_text())) is None  # it cuts: an effect
    gens = [_generation(VANILLA_ANSWER, 20), _generation("The capital of France is Paris, a large city.", 12)]
    damage = {"continuations": ["Hello there."], "text_sequences": [[1, 2, 3, 4]], "text_nll": [3.0]}
    suite = CanarySuite(freeform=[{"prompt": "What is the speed of light?", "keywords": ["299"], "source": "general"},
                                  {"prompt": "What is the capital of France?", "keywords": ["Paris"],
                                   "source": "behavior"}],
                        decisions=None, neutral_prompts=["Say hello."], neutral_texts=["x"])
    thresholds = {"effect": "length_cut", "min_effect": 0.0}
    same = build_report(suite, {"generations": gens, "damage": damage},
                        {"generations": list(gens), "damage": {"kl": [[0.0, 0.0]], "text_nll": [3.0]}},
                        thresholds=thresholds, quality="keywords", integrity=None, settings={},
                        labels=("base", "variant"))
    same["gate"] = evaluate(same, thresholds)
    assert same["gate"]["passed"] and no_measured_effect(same) == 0.0
    copy = tmp_path / "v"
    shutil.copytree(variant, copy)
    (copy / CANARY_JSON).write_text(json.dumps(same))
    assert "No measured effect" in render_card(copy, "you/x")
    assert "No measured effect" not in render_card(variant, "you/x")
