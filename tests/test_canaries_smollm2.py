"""The canary on the embedded SmolLM2-135M-Instruct (a plain causal LM) and a low-rank variant of it (slow)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_canaries_support import make_variant

from clef_model.checkpoint import CheckpointReader

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_variant(smollm2_path, tmp_path_factory):
    names = [n for n in CheckpointReader(smollm2_path).names() if n.endswith(("layers.10.mlp.down_proj.weight",
                                                                              "layers.12.self_attn.o_proj.weight"))]
    assert len(names) == 2
    return make_variant(smollm2_path, tmp_path_factory.mktemp("smol") / "variant", names, rank=1, relative=0.05), names


def test_smollm2_canary_decisions_do_not_apply_freeform_and_damage_work(smollm2_path, smollm2_variant, tmp_path):
    from variants.cli import main

    variant, names = smollm2_variant
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"prompt": "What is the speed of light?", "keywords": ["299", "300"]}\n'
                    '{"prompt": "How many legs does a spider have?", "keywords": ["8", "eight"]}\n')
    result = CliRunner().invoke(main, ["canary", str(variant), "--against", str(smollm2_path), "--suite", str(chat),
                                       "--max-new-tokens", "24", "--damage-tokens", "8", "--device", "cpu",
                                       "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"),
                                       "--max-first-token-kl", "10", "--max-mean-token-kl", "10"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["decisions"]["applicable"] is False
    assert "does not apply" in report["decisions"]["reason"]
    assert "Typed-decision canaries: does not apply" in (tmp_path / "r.md").read_text()
    assert "typed decisions: does not apply" in result.output
    assert not any(check["name"] == "decision_drift" for check in report["gate"]["checks"])
    rows = report["freeform"]["prompts"]
    assert len(rows) == 2 and all(row["base"]["tokens"] > 0 and row["variant"]["text"] for row in rows)
    assert "299" in rows[0]["base"]["text"]                              # the real model knows the fact
    damage = report["damage"]["summary"]
    assert damage["first_token_kl"]["mean"] > 0 and damage["mean_token_kl"] > 0
    assert 1 < damage["perplexity"]["base"] < 100 and 1 < damage["perplexity"]["variant"] < 1000
    integrity = report["integrity"]
    assert integrity["passed"] and integrity["joint_head_sha256"] is None
    assert sorted(c["name"] for c in integrity["changed_tensors"]) == sorted(names)
    assert all(c["rank"] == 1 for c in integrity["changed_tensors"])
