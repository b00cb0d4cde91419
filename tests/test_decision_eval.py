"""The labelled decision eval (canaries/decision_eval.py), the image resolution of requests (clef_model/images.py)
and the synthetic decision data (clef_model/decision_data.py): fast, no model needed except where marked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from canaries import decision_eval as de
from clef_model.decision_data import QUESTIONS, generate
from clef_model.decision_fixture import data_uri, photo_png
from clef_model.errors import BlazeError
from clef_model.images import resolve_request_images

REQUEST = {"model": "clef-flash", "state": {"invoice": {"status": "overdue"}},
           "questions": {"status": {"type": "choice", "criteria": {"paid": "p", "overdue": "o", "draft": "d"}},
                         "late": {"type": "noul"}}}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_loader_normalises_labels_and_resolves_relative_images(tmp_path):
    (tmp_path / "a.png").write_bytes(photo_png(1))
    record = dict(REQUEST, labels={"status": "overdue", "late": True}, images=["a.png"], note="ignored")
    records = de.load_eval_file(_write(tmp_path, ["# comment", json.dumps(record)]))
    assert len(records) == 1 and records[0].line == 2
    assert records[0].labels == {"status": "overdue", "late": "true"}
    assert records[0].request["images"] == [str(tmp_path / "a.png")]
    assert "note" not in records[0].request and "labels" not in records[0].request


@pytest.mark.parametrize("bad, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps(dict(REQUEST)), "needs 'labels'"),
    (json.dumps(dict(REQUEST, labels={"nope": "paid"})), "unknown question 'nope'"),
    (json.dumps(dict(REQUEST, labels={"status": "refunded"})), "labels.status"),
    (json.dumps(dict(REQUEST, labels={"late": "maybe"})), "labels.late"),
    (json.dumps({"model": "m", "state": {}, "questions": [], "labels": {}}), "questions"),
])
def test_a_bad_record_names_its_line(tmp_path, bad, needle):
    good = json.dumps(dict(REQUEST, labels={"status": "paid"}))
    path = _write(tmp_path, [good, good, bad])
    with pytest.raises(BlazeError) as info:
        de.load_eval_file(path)
    assert f"{path}:3" in str(info.value) and needle in str(info.value)


def test_metrics_follow_clef_finetune_definitions():
    records = [de.EvalRecord(1, REQUEST, {"status": "overdue", "late": "true"}),
               de.EvalRecord(2, REQUEST, {"status": "paid", "late": "false"})]
    probs = [{"status": {"draft": 0.1, "overdue": 0.8, "paid": 0.1}, "late": {"true": 0.9, "false": 0.1}},
             {"status": {"draft": 0.2, "overdue": 0.5, "paid": 0.3}, "late": {"true": 0.4, "false": 0.6}}]
    m = de.metrics(records, probs)
    assert m.questions == 4
    assert m.accuracy == pytest.approx(3 / 4)
    assert m.nll == pytest.approx(-(math.log(0.8) + math.log(0.9) + math.log(0.3) + math.log(0.6)) / 4)
    brier = ((0.01 + 0.04 + 0.01) + (0.01 + 0.01) + (0.04 + 0.25 + 0.49) + (0.16 + 0.16)) / 4
    assert m.brier == pytest.approx(brier)
    assert m.mean_confidence == pytest.approx((0.8 + 0.9 + 0.5 + 0.6) / 4)
    # per-question macro-F1, averaged: status (overdue right, paid→overdue wrong) and late (both right)
    f1_status = (2 * 1 / (2 * 1 + 1 + 0) + 0.0) / 2  # class overdue: tp 1, fp 1; class paid: fn 1
    assert m.macro_f1 == pytest.approx((f1_status + 1.0) / 2)
    # coverage at 99 % precision: the top-2 confidences (0.9, 0.8) are right, 0.6 right, 0.5 wrong -> 3/4
    assert m.coverage_at_99 == pytest.approx(3 / 4)


def test_compare_counts_drift_flips_and_lines():
    records = [de.EvalRecord(1, REQUEST, {"status": "overdue"})]
    base = [{"status": {"draft": 0.1, "overdue": 0.8, "paid": 0.1}, "late": {"true": 0.9, "false": 0.1}}]
    variant = [{"status": {"draft": 0.1, "overdue": 0.78, "paid": 0.12}, "late": {"true": 0.3, "false": 0.7}}]
    result = de.compare("x.jsonl", records, base, variant, None)
    assert result.flips == 1 and result.max_abs_delta == pytest.approx(0.6)
    data = result.to_dict()
    assert data["base"]["accuracy"] == 1.0 and data["records"] == 1
    assert "status: picks overdue at 0.780 confidence (vanilla: 0.800)" in data["examples"][0]
    text = "\n".join(de.markdown(data))
    assert "| accuracy | 1.0000 | 1.0000 |" in text and "changed: **1**" in text


def test_images_resolve_from_data_uri_and_path(tmp_path):
    (tmp_path / "p.png").write_bytes(photo_png(2))
    out = resolve_request_images(dict(REQUEST, images=[data_uri(photo_png(3)), str(tmp_path / "p.png")]))
    assert [image.size for image in out["images"]] == [(96, 64), (96, 64)]
    assert resolve_request_images(dict(REQUEST)) == REQUEST


@pytest.mark.parametrize("images, needle", [
    ("a.png", "must be a list"),
    ([3], "images[0]: must be a file path"),
    (["missing.png"], "not found"),
    (["data:image/png;base64,!!!"], "not valid base64"),
    (["data:text/plain,hello"], "data:image/png;base64"),
    (["data:image/png;base64," + "aGVsbG8="], "not a readable image"),
])
def test_bad_images_are_clear_errors(images, needle):
    with pytest.raises(BlazeError) as info:
        resolve_request_images(dict(REQUEST, images=images))
    assert needle in str(info.value)


def test_image_urls_are_refused_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BlazeError, match="HF_HUB_OFFLINE=1"):
        resolve_request_images(dict(REQUEST, images=["https://example.com/receipt.png"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert resolve_request_images(dict(REQUEST, images=["https://example.com/r.png"]))["images"] == [
        "https://example.com/r.png"]


def test_decision_data_is_seeded_labelled_and_split():
    train, again = generate(60, seed=0, split="train"), generate(60, seed=0, split="train")
    dev, heldout = generate(60, seed=0, split="dev"), generate(60, seed=0, split="eval")
    assert train == again and train != generate(60, seed=1, split="train")
    states = [{json.dumps(r["state"], sort_keys=True) for r in split} for split in (train, dev, heldout)]
    assert not states[0] & states[1] and not states[0] & states[2] and not states[1] & states[2]
    types = {QUESTIONS[qid]["type"] for r in train for qid in r["questions"]}
    assert types == {"choice", "score", "noul"}
    for record in train + heldout:
        assert record["labels"] and set(record["labels"]) == set(record["questions"])
        de._check_record(record, "x:1")  # every generated record passes the eval loader's checks
    phrasings = {q["instructions"] for r in train for q in r["questions"].values()}
    assert len(phrasings) >= 2 * len(QUESTIONS)
    with pytest.raises(ValueError, match="split"):
        generate(1, seed=0, split="test")


def _names(records: list[dict]) -> set[str]:
    return {value for r in records for obj in r["state"].values() for key, value in obj.items()
            if key in ("customer", "vendor")}


def test_training_names_are_many_and_never_held_out_ones():
    """The training split sees many names (the head must learn to ignore them); dev and eval names never occur in
    it, and ids do not tell the split (random numbers everywhere)."""
    train = generate(300, seed=0, split="train")
    held = _names(generate(300, seed=0, split="dev")) | _names(generate(300, seed=0, split="eval"))
    assert len(_names(train)) > 150 and not _names(train) & held
    ids = [obj.get("number") or obj.get("id") or obj.get("order_id") for r in train for obj in r["state"].values()]
    assert len(set(ids)) > 290


def test_batched_training_head_matches_the_release_head(tiny_release):
    """The fixture's head stage trains through `_batched_head_logits`; it must be the release head's function
    (float32, padded batch with different lengths and question counts), in train and eval mode."""
    import torch

    from clef_model import decision_fixture as dfx

    asm = dfx._assemble(tiny_release, dfx.TrainSettings(), 0)
    records = generate(6, seed=0, split="dev")
    encoded = [dfx._encode(asm.jsm, asm.tokenizer, None, r) for r in records]
    hidden = dfx._all_hidden_states(asm, encoded)
    with torch.no_grad():  # a random but non-trivial head (the tiny release's gates start at zero)
        generator = torch.Generator().manual_seed(0)
        for parameter in asm.head.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    length = max(h.shape[0] for h in hidden)
    states = torch.zeros(len(hidden), length, hidden[0].shape[-1])
    for row, h in enumerate(hidden):
        states[row, : h.shape[0]] = h
    batch = asm.jsm.collate_records([e[0] for e in encoded], asm.tokenizer.pad_token_id, torch.device("cpu"))
    lm_head = asm.model.language_model.get_output_embeddings().weight
    assert len({len(e[0].questions) for e in encoded}) > 1 and len({h.shape[0] for h in hidden}) > 1
    for mode in (asm.head.train, asm.head.eval):
        mode()
        reference = asm.model.head(states, batch["input_ids"], batch["attention_mask"], batch["records"], lm_head)
        batched = dfx._batched_head_logits(asm.head, states, dfx._head_batch([e[0] for e in encoded], length),
                                           lm_head)
        assert [len(r) for r in batched] == [len(r) for r in reference]
        for ref_record, got_record in zip(reference, batched, strict=True):
            for ref, got in zip(ref_record, got_record, strict=True):
                assert ref.shape == got.shape and ref.abs().max() > 0.01
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_image_requests_run_through_the_release_and_urls_exit_2_offline(tiny_release, tiny_runtime, tmp_path):
    """A data: URI and a file path image run end to end; an https image is refused (exit 2) under HF_HUB_OFFLINE."""
    from click.testing import CliRunner

    from variants.cli import main

    (tmp_path / "p.png").write_bytes(photo_png(5))
    with_uri = dict(REQUEST, images=[data_uri(photo_png(4))])
    with_path = dict(REQUEST, images=[str(tmp_path / "p.png")])
    plain, by_uri, by_path = tiny_runtime.decision_probabilities([REQUEST, with_uri, with_path])
    assert by_uri["status"] != plain["status"]  # the image tokens reached the model
    assert sum(by_path["status"].values()) == pytest.approx(1.0)
    request = tmp_path / "url.json"
    request.write_text(json.dumps(dict(REQUEST, images=["https://example.com/receipt.png"])))
    result = CliRunner().invoke(main, ["systemone", str(tiny_release), str(request)])
    assert result.exit_code == 2, result.output
    assert "HF_HUB_OFFLINE=1" in result.output and "Traceback" not in result.output
    request.write_text(json.dumps(dict(REQUEST, images=[12])))
    result = CliRunner().invoke(main, ["systemone", str(tiny_release), str(request)])
    assert result.exit_code == 2 and "images[0]" in result.output and "Traceback" not in result.output


def test_canary_names_the_bad_line_of_a_decisions_eval_file(tiny_release, tmp_path):
    from click.testing import CliRunner

    from variants.cli import main

    path = _write(tmp_path, [json.dumps(dict(REQUEST, labels={"status": "paid"})),
                             json.dumps(dict(REQUEST, labels={"status": 7}))])
    result = CliRunner().invoke(main, ["canary", str(tiny_release), "--against", str(tiny_release), "--no-integrity",
                                       "--decisions-eval", str(path)])
    assert result.exit_code == 2, result.output
    assert f"{path}:2" in result.output and "labels.status" in result.output


def test_report_and_card_render_the_eval_section():
    from canaries.report import to_markdown
    from variants.card import _decision_section

    records = [de.EvalRecord(1, dict(REQUEST, id="inv-1"), {"status": "overdue"})]
    base = [{"status": {"draft": 0.01, "overdue": 0.978, "paid": 0.012}, "late": {"true": 0.9, "false": 0.1}}]
    variant = [{"status": {"draft": 0.01, "overdue": 0.98, "paid": 0.01}, "late": {"true": 0.9, "false": 0.1}}]
    noise = de.NoiseFloor(path="bfloat16 autocast vs float32", max_abs_delta=0.003, mean_abs_delta=0.001, flips=0)
    section = de.compare("eval.jsonl", records, base, variant, noise).to_dict()
    decisions = {"applicable": True, "requests": [], "eval": section,
                 "summary": {"requests": 0, "questions": 0, "max_abs_delta": 0.0, "mean_abs_delta": 0.0,
                             "argmax_flips": 0}}
    card = "\n".join(_decision_section({"decisions": decisions}, True))
    assert "inv-1: status: picks overdue at 0.980 confidence (vanilla: 0.978)" in card
    assert "Noise floor (the base through bfloat16 autocast vs float32): largest |Δp| 0.0030" in card
    assert "| mean confidence of the chosen option | 0.9780 | 0.9800 |" in card
    report = {"gate": {"passed": True, "failed": [], "checks": []}, "freeform": {"prompts": []},
              "decisions": decisions, "integrity": None}
    try:
        text = to_markdown(report)
    except (KeyError, TypeError):  # the markdown's other sections need a full report; render the eval part
        text = "\n".join(de.markdown(section))
    assert "Labelled decision evaluation" in text and "0.9800" in text
