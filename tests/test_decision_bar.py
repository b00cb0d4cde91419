"""Issue 13's bar, end to end through the CLI, on the trained decision fixture:

    blaze fixture --preset decisions D
    blaze edit --base D --behavior verbosity --strength 0.3 --no-canary --out V
    blaze canary V --against D --decisions-eval D/decision_eval.jsonl --json R.json

R.json `decisions.eval`: records ≥ 200; base accuracy ≥ 0.95 and mean confidence ≥ 0.9; variant accuracy ≥ base
− 0.005; max |Δp| ≤ 0.01; flips = 0. The fixture is cached in $BLAZE_CACHE (its first build trains for a few
minutes); the canary's free-form part runs with few tokens, since only the decisions are asserted here.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from clef_model.decision_fixture import DEV_FILE, EVAL_FILE, cached_decision_fixture
from variants.cli import main

# Opt-in (BLAZE_DECISION_BAR=1): slow on CPU. On the BUILD_VERSION 4 fixture the bar's edit gives, through
# canaries.decision_eval (what the canary calls), records 240, accuracy 1.000 / 1.000, mean confidence 0.99997,
# max |Δp| 0.0017 and 0 flips, with the unedited base's own bf16 noise floor at 0.0016 (README "Typed decisions,
# measured"; v3 missed max |Δp| with 0.022 against a floor of 0.0228). A cold cache also trains the fixture
# (~1.6 min CPU, 2.3 min wall on the shared 2-core VM) and collects the verbosity statistics (~1 min CPU); with
# the fixture cached the bar test took 1 min 44 s (the same figures through the CLI canary, max |Δp| 0.00166).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("BLAZE_DECISION_BAR") != "1",
                       reason="opt-in: BLAZE_DECISION_BAR=1 (trains the decision fixture on a cold cache)"),
]


def _run(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), f"blaze {' '.join(args)} -> {result.exit_code}\n{result.output[-3000:]}"


def test_bar_trained_decisions_survive_the_default_verbosity_edit(tmp_path):
    cached = cached_decision_fixture()  # the first build trains; later sessions copy the cached folder
    d, v, r = tmp_path / "D", tmp_path / "V", tmp_path / "R.json"
    _run(["fixture", "--preset", "decisions", str(d)])
    assert (d / EVAL_FILE).is_file() and (d / "joint_schema_model.py").is_file()
    # OUT = the cached build + the dev split, written at copy time (build_decision_fixture)
    assert sorted(p.name for p in d.iterdir()) == sorted([p.name for p in cached.iterdir()] + [DEV_FILE])
    # the edit reads the cached folder (the same bytes as D): blaze's statistics cache is keyed by the base's
    # path, so a stable path collects the verbosity statistics once, not in every session
    _run(["edit", "--base", str(cached), "--behavior", "verbosity", "--strength", "0.3", "--no-canary", "--out",
          str(v), "--device", "cpu"])
    assert (v / "blaze_delta.safetensors").is_file()
    _run(["canary", str(v), "--against", str(d), "--decisions-eval", str(d / EVAL_FILE), "--json", str(r),
          "--device", "cpu", "--max-new-tokens", "4", "--damage-tokens", "4", "--no-prompted", "--no-integrity"])
    section = json.loads(r.read_text())["decisions"]["eval"]
    base, variant = section["base"], section["variant"]
    print(f"\nbar: records {section['records']}, base accuracy {base['accuracy']:.4f}, confidence "
          f"{base['mean_confidence']:.4f}, variant accuracy {variant['accuracy']:.4f}, max |Δp| "
          f"{section['max_abs_delta']:.5f}, flips {section['flips']}, noise floor {section['noise_floor']}")
    assert section["records"] >= 200
    assert base["accuracy"] >= 0.95 and base["mean_confidence"] >= 0.9
    assert variant["accuracy"] >= base["accuracy"] - 0.005
    assert section["max_abs_delta"] <= 0.01
    assert section["flips"] == 0
    assert section["noise_floor"]["path"] and section["noise_floor"]["max_abs_delta"] >= 0


def test_decision_fixture_keeps_the_release_layout_and_holds_out_its_eval(tiny_release):
    from clef_model.checkpoint import CheckpointReader
    from clef_model.decision_data import generate
    from clef_model.decision_fixture import TRAIN_INFO_FILE, TrainSettings
    from clef_model.trust import is_known_release_code

    folder = cached_decision_fixture()
    trained, tiny = CheckpointReader(folder), CheckpointReader(tiny_release)
    assert [(n, trained.dtype(n), trained.shape(n)) for n in trained.names()] == \
        [(n, tiny.dtype(n), tiny.shape(n)) for n in tiny.names()]  # mtp.* included, same order and dtypes
    assert any(n.startswith("mtp.") for n in trained.names())
    assert is_known_release_code(folder / "joint_schema_model.py")
    assert (folder / "joint_head.safetensors").read_bytes() != (tiny_release / "joint_head.safetensors").read_bytes()
    info = json.loads((folder / TRAIN_INFO_FILE).read_text())
    assert info["changed_tensors"] > 0  # LoRA was merged into the backbone
    lines = [json.loads(line) for line in (folder / EVAL_FILE).read_text().splitlines()]
    assert len(lines) >= 200 and sum(bool(r.get("images")) for r in lines) >= 2
    train = generate(TrainSettings().train_records, seed=0, split="train")
    assert not {json.dumps(r["state"], sort_keys=True) for r in train} & \
        {json.dumps(r["state"], sort_keys=True) for r in lines}
