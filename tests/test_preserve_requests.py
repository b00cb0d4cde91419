"""`blaze edit --preserve-requests FILE.jsonl` (issue 13): the user's own decision traffic joins the preserve set.

Also the decision fixture's `decision_dev.jsonl`, the stand-in for that traffic (the `dev` split, written at copy
time, never an eval or training record).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import faults_support
import pytest
from click.testing import CliRunner

from clef_model.decision_data import generate
from clef_model.errors import BlazeError
from variants.cli import main


def _requests_file(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _traffic(tmp_path: Path, name: str = "traffic.jsonl", image: bool = True) -> Path:
    """Three dev-split requests (one without labels) and, with ``image``, one more carrying an image."""
    from clef_model.decision_fixture import data_uri, photo_png

    records = generate(4, seed=0, split="dev")
    records[1] = {k: v for k, v in records[1].items() if k != "labels"}  # labels are optional
    if image:
        records[3] = dict(records[3], images=[data_uri(photo_png(1))])
    else:
        records = records[:3]
    return _requests_file(tmp_path / name, records)


def test_requests_reach_the_preserve_set_and_images_are_counted(tiny_runtime, tmp_path):
    from variants.build import load_preserve_requests, preserve_set
    from variants.spec import load_behavior

    path = _traffic(tmp_path)
    own = load_preserve_requests([path])
    assert len(own.requests) == 3 and own.skipped == 1
    assert [f.to_dict() for f in own.files] == [{"file": "traffic.jsonl", "requests": 3, "skipped_images": 1,
                                                 "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}]
    assert all("labels" not in r and not r.get("images") for r in own.requests)
    spec = load_behavior("verbosity")
    default = preserve_set(spec, tiny_runtime)
    keep = preserve_set(spec, tiny_runtime, own)
    assert keep.requests == default.requests + own.requests
    assert [r["id"] for r in keep.requests[-3:]] == ["invoice-dev-0", "ticket-dev-1", "shipment-dev-2"]


def test_the_option_is_repeatable_and_reaches_the_build(monkeypatch, tmp_path):
    from variants import build as build_mod

    seen = {}

    def fake_build(opts, echo):
        seen["opts"] = opts
        raise BlazeError("stop here")

    monkeypatch.setattr(build_mod, "build_variant", fake_build)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    result = CliRunner().invoke(main, ["edit", "--behavior", "verbosity", "--out", str(tmp_path / "o"),
                                       "--preserve-requests", str(a), "--preserve-requests", str(b)])
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["opts"].preserve_requests == (a, b)


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"model": "clef-flash", "state": {}, "questions": {}}), "question"),
    ("[1, 2]", "expected a JSON object"),
])
def test_a_bad_line_exits_2_naming_file_and_line(tiny_release, tmp_path, line, needle):
    good = json.dumps(generate(1, seed=0, split="dev")[0])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{good}\n{line}\n", encoding="utf-8")
    result = CliRunner().invoke(main, ["edit", "--behavior", "verbosity", "--base", str(tiny_release),
                                       "--out", str(tmp_path / "o"), "--device", "cpu", "--strength", "0.1",
                                       "--no-canary", "--preserve-requests", str(bad)])
    assert result.exit_code == 2, result.output
    assert f"{bad}:2" in result.output and needle in result.output
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()
    missing = CliRunner().invoke(main, ["edit", "--behavior", "verbosity", "--out", str(tmp_path / "o"),
                                        "--preserve-requests", str(tmp_path / "nope.jsonl")])
    assert missing.exit_code == 2 and "nope.jsonl not found" in missing.output


def test_statistics_fingerprint_and_cache_file_change_with_the_requests(tiny_runtime, tmp_path):
    from surgery.plan import statistics_fingerprint
    from surgery.statistics import PreserveSet
    from variants.build import BuildOptions, _cache_file, contrast_pairs, edit_settings, load_preserve_requests
    from variants.spec import load_behavior

    spec = load_behavior("verbosity")
    pairs = contrast_pairs(spec)[:2]
    first = load_preserve_requests([_traffic(tmp_path, "a.jsonl", image=False)])
    records = generate(4, seed=0, split="dev")
    records[0] = dict(records[0], id="changed")
    second = load_preserve_requests([_requests_file(tmp_path / "b.jsonl", records[:3])])

    def fingerprint(requests: list[dict]) -> str:
        return statistics_fingerprint(tiny_runtime, pairs, PreserveSet(texts=["hi"], requests=requests), [],
                                      {"layers": "2-4"})

    assert fingerprint(first.requests) != fingerprint([])
    assert fingerprint(first.requests) != fingerprint(second.requests)
    assert fingerprint(first.requests) == fingerprint(list(first.requests))
    opts = BuildOptions(behavior="verbosity", out=tmp_path / "o", cache_dir=tmp_path / "cache")
    s = edit_settings(spec, opts)
    files = {_cache_file(opts, tiny_runtime, spec, s),
             _cache_file(opts, tiny_runtime, spec, s, preserved=tuple(str(f.sha256) for f in first.files)),
             _cache_file(opts, tiny_runtime, spec, s, preserved=tuple(str(f.sha256) for f in second.files))}
    assert len(files) == 3


def test_edit_records_the_files_in_the_manifest_and_on_the_card(tiny_release, tmp_path):
    from canaries.suites import default_decision_suite, request_bodies
    from clef_model.manifest import PreservedFile
    from surgery.manifest import read_manifest
    from variants.build import BuildOptions, build_variant
    from variants.card import render_card

    spec = faults_support.small_spec(tmp_path, strength=0.2)
    path = _traffic(tmp_path)
    lines: list[str] = []
    out = tmp_path / "variant"
    result = build_variant(BuildOptions(behavior=str(spec), out=out, base=str(tiny_release), device="cpu",
                                        canary=False, cache_dir=tmp_path / "cache", progress=False,
                                        preserve_requests=(path,)), echo=lines.append)
    data_line = next(line for line in lines if line.startswith("data:"))
    assert "3 from --preserve-requests traffic.jsonl; 1 with images skipped" in data_line
    manifest = read_manifest(out)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest.edit.preserve_files == (PreservedFile(file="traffic.jsonl", sha256=digest, requests=3,
                                                          skipped_images=1),)
    suite = [r for r in request_bodies(default_decision_suite()) if not r.get("images")]
    assert manifest.edit.extra["statistics"]["preserve_requests"] == len(suite) + 3
    assert result.patch.metadata["statistics"]["preserve_requests"] == len(suite) + 3
    card = render_card(out)
    assert f"`traffic.jsonl`, 3 requests in the preserve set; 1 with images left out (SHA-256 `{digest}`)" in card


def test_the_decision_fixture_writes_a_dev_file_apart_from_eval_and_training(monkeypatch, tmp_path):
    from canaries.decision_eval import load_eval_file
    from clef_model import decision_fixture as dfx

    cached = tmp_path / "cached"
    cached.mkdir()
    eval_records = generate(dfx.TrainSettings().eval_records, seed=0, split="eval")
    (cached / dfx.EVAL_FILE).write_text("".join(json.dumps(r) + "\n" for r in eval_records), encoding="utf-8")
    monkeypatch.setattr(dfx, "cached_decision_fixture", lambda seed=0: cached)
    first = dfx.build_decision_fixture(tmp_path / "D1")
    second = dfx.build_decision_fixture(tmp_path / "D2")
    assert (first / dfx.EVAL_FILE).read_bytes() == (cached / dfx.EVAL_FILE).read_bytes()  # copied, not rebuilt
    dev = (first / dfx.DEV_FILE).read_bytes()
    assert dev == (second / dfx.DEV_FILE).read_bytes()  # deterministic for the seed
    records = [json.loads(line) for line in dev.decode().splitlines()]
    assert len(records) >= 200 and all(r["id"].split("-")[1] == "dev" for r in records)
    assert len(load_eval_file(first / dfx.DEV_FILE)) == len(records)  # labelled: usable as an eval file too

    def states(rs: list[dict]) -> set[str]:
        return {json.dumps(r["state"], sort_keys=True) for r in rs}

    def prompts(rs: list[dict]) -> set[str]:
        return {json.dumps([r["state"], r["questions"]], sort_keys=True) for r in rs}

    train = generate(dfx.TrainSettings().train_records, seed=0, split="train")
    assert not states(records) & states(eval_records) and not prompts(records) & prompts(eval_records)
    assert not states(records) & states(train)
