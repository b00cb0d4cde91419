"""`blaze edit` end to end on the tiny Clef fixture: variant folder, canary report inside, sweep, errors."""

from __future__ import annotations

import json
from pathlib import Path

import faults_support
import pytest
import torch
from click.testing import CliRunner

from clef_model.checkpoint import CheckpointReader
from clef_model.errors import BlazeError
from surgery.manifest import read_manifest, verify_manifest
from variants import build as build_mod
from variants.build import BuildOptions, build_variant


def small_spec(tmp_path, **defaults):
    """The fault suites' tiny spec (tests/faults_support.py) at strength 0.2 unless `defaults` say otherwise."""
    return faults_support.small_spec(tmp_path, **{"strength": 0.2, **defaults})


@pytest.fixture(scope="module")
def built(tiny_release, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    spec = small_spec(tmp)
    outs = []
    for i in range(2):
        out = tmp / f"variant{i}"
        build_variant(BuildOptions(behavior=str(spec), out=out, base=str(tiny_release), device="cpu", canary=False,
                                   cache_dir=tmp / "cache", progress=False), echo=lambda _m: None)
        outs.append(out)
    return outs


def test_variant_is_drop_in_and_only_targets_change(built, tiny_release):
    out = built[0]
    base, variant = CheckpointReader(tiny_release), CheckpointReader(out)
    assert (out / "joint_head.safetensors").read_bytes() == (tiny_release / "joint_head.safetensors").read_bytes()
    manifest = read_manifest(out).to_dict()
    edited = set(manifest["edited_tensors"])
    assert len(edited) == 6 and all(".layers.2." in n or ".layers.3." in n or ".layers.4." in n for n in edited)
    assert set(base.names()) == set(variant.names())
    for name in base.names():
        same = base.raw_bytes(name) == variant.raw_bytes(name)
        assert same == (name not in edited), name
    from surgery.patch import Patch

    patch = Patch.load(out / "blaze_delta.safetensors")
    for name in edited:
        matrix = name[: -len(".weight")]
        assert patch.rank(matrix) == 1 and patch.numerical_rank(matrix) <= 1
        assert manifest["matrices"][matrix]["numerical_rank"] <= 1
        w = base.tensor(name).double()
        delta = variant.tensor(name).double() - w
        eps = torch.finfo(variant.tensor(name).dtype).eps
        # the stored delta is U Vᵀ up to rounding W + U Vᵀ to the stored dtype
        assert (delta - patch.delta(matrix).double()).abs().max() <= 2 * eps * (w.abs().max() + delta.abs().max())
    assert verify_manifest(out) == []
    edit = manifest["edit"]
    assert edit["strength"] == 0.2 and edit["strength_mode"] == "fixed" and edit["method"] == "steer"
    assert edit["spec_hash"] and edit["layers"] == [2, 3, 4]


def test_two_runs_give_identical_shards(built):
    a, b = built
    shards = sorted(p.name for p in a.glob("*.safetensors"))
    assert shards == sorted(p.name for p in b.glob("*.safetensors"))
    for name in shards:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_apply_of_the_edit_patch_reproduces_its_shards(built, tiny_release, tmp_path):
    """`blaze apply` of the blaze_delta.safetensors that `blaze edit` wrote gives the edit's files byte for byte."""
    from variants.cli import main

    out = built[0]
    result = CliRunner().invoke(main, ["apply", str(out / "blaze_delta.safetensors"), "--base", str(tiny_release),
                                       "--out", str(tmp_path / "applied")])
    assert result.exit_code == 0, result.output
    applied = tmp_path / "applied"
    edited = set(read_manifest(out).output.files)
    assert set(read_manifest(applied).output.files) == edited - {"blaze_canary.json", "blaze_canary.md"}
    for name in sorted(out.glob("*.safetensors")):
        assert (applied / name.name).read_bytes() == name.read_bytes(), name.name
    for name in sorted(edited - {"blaze_canary.json", "blaze_canary.md"}):
        assert (applied / name).read_bytes() == (out / name).read_bytes(), name


def test_refuses_non_empty_out_and_bad_layers(tiny_release, tmp_path):
    spec = small_spec(tmp_path)
    out = tmp_path / "full"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(BlazeError, match="not empty"):
        build_variant(BuildOptions(behavior=str(spec), out=out, base=str(tiny_release), canary=False),
                      echo=lambda _m: None)
    assert (out / "x").read_text() == "keep me"
    from variants.cli import main

    result = CliRunner().invoke(main, ["edit", "--behavior", str(spec), "--out", str(tmp_path / "o"), "--base",
                                       str(tiny_release), "--layers", "2-99", "--no-canary", "--device", "cpu"])
    assert result.exit_code == 2 and "out of range" in result.output
    assert not (tmp_path / "o").exists()
    result = CliRunner().invoke(main, ["edit", "--behavior", "no-such-behaviour", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2


@pytest.mark.slow
def test_auto_strength_with_real_canaries(tiny_release, tmp_path):
    """--strength auto on the fixture with the real canary runner: a sweep table and a report in the folder."""
    spec = small_spec(tmp_path, strength="auto")
    # the random-weight fixture's decisions are near ties, so any edit flips a few: widen the decision bounds
    # for this test of the sweep machinery (the real gate defaults are exercised in tests/test_canaries_*)
    data = json.loads(spec.read_text())
    data["gate"].update({"max_decision_drift": 0.5, "max_argmax_flips": 20})
    spec.write_text(json.dumps(data))
    out = tmp_path / "auto"
    result = build_variant(BuildOptions(behavior=str(spec), out=out, base=str(tiny_release), device="cpu",
                                        cache_dir=tmp_path / "cache", progress=False, budget=4),
                           echo=lambda _m: None)
    # effect "none": the search steps up from the grid's top (0.1) until a damage check fails, then bisects
    assert result.search is not None and result.search.chosen is not None and result.search.passes <= 4
    assert result.strength == result.search.chosen.point.strength
    assert all(row.point.strength > result.strength for row in result.search.rows if row.damaged)
    manifest = read_manifest(out)
    assert manifest.edit.strength_mode == "auto" and len(manifest.edit.sweep) == len(result.search.rows)
    assert manifest.edit.extra["search"]["passes"] == result.search.passes
    report = json.loads((out / build_mod.CANARY_JSON).read_text())
    assert "gate" in report and (out / build_mod.CANARY_MD).is_file()
    # integrity is checked on the written folder before it is finalised, and is part of the gate
    assert report["integrity"]["passed"] is True
    assert any(c["name"] == "integrity" for c in report["gate"]["checks"])
    assert verify_manifest(out) == []
    # `blaze canary` with the same defaults (batch size, tokens, suites) reuses the base answers the edit's
    # final canary cached on disk: the same base side, generated once
    from variants.cli.canary import run_command

    again = run_command(str(out), str(tiny_release), str(spec), (), None, None, None, "cpu", False, None, "together",
                        True, dict(max_decision_drift=0.5, max_argmax_flips=20))
    assert again["meta"]["base_from_cache"] is True
    assert [p["base"] for p in again["freeform"]["prompts"]] == [p["base"] for p in report["freeform"]["prompts"]]
    assert again["freeform"]["summary"] == report["freeform"]["summary"]


def test_read_positions_prefers_system_prompt_contrast():
    from surgery.directions import ContrastPair
    from variants.build import read_positions

    with_systems = [ContrastPair("q", "a", "b", "Be brief.", "Be detailed.")]
    assert read_positions(with_systems) == "shared_response"
    assert read_positions(with_systems + [ContrastPair("q", "a", "b")]) == "response"
    assert read_positions([ContrastPair("q", "a", "b", "same", "same")]) == "response"


def test_questions_preserve_adds_the_training_questions_but_no_validation_or_heldout_prompt():
    """--questions preserve: the preserve set gains the training questions (the training-question check's
    set); a training prompt that is also a validation or held-out item never enters, and `edit` adds none."""
    from types import SimpleNamespace

    from variants.build import BuildOptions, edit_settings, preserve_set
    from variants.spec import load_behavior

    spec = load_behavior("verbosity")
    runtime = SimpleNamespace(is_clef=False)
    assert preserve_set(spec, runtime).questions == []
    asked = preserve_set(spec, runtime, questions=True).questions
    training = {repr(q["prompt"]) for q in spec.training_questions()}
    held = {repr(i["prompt"]) for i in spec.validation_items() + spec.heldout_items()}
    assert asked and {repr(q) for q in asked} == training - held
    settings = edit_settings(spec, BuildOptions(behavior="verbosity", out=Path("unused"), questions="preserve"))
    assert settings.questions == "preserve"
    with pytest.raises(BlazeError, match="questions: must be one of edit, preserve"):
        edit_settings(spec, BuildOptions(behavior="verbosity", out=Path("unused"), questions="maybe"))


def test_a_chosen_point_without_effect_is_warned_about() -> None:
    from variants.build import _warn_if_no_effect
    from variants.search import Point, Row

    point = Point(strength=0.1, method="steer", lam=1.0, layers="0.3-0.8", kinds="writers")
    said: list[str] = []
    _warn_if_no_effect(Row(point=point, passed=True, failed=(), values={"effect": 0.0}), 0.0, said.append)
    assert len(said) == 1 and "no effect" in said[0] and "+0.000" in said[0]
    for values in ({"effect": 0.038}, {}):  # an effect, or a gate that measures none: nothing to say
        _warn_if_no_effect(Row(point=point, passed=True, failed=(), values=values), 0.0, said.append)
    assert len(said) == 1
