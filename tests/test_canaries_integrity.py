"""Integrity: only the edited tensors differ, with their rank; head/code changes fail; other bases refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_canaries_support import WRITERS, make_variant

from canaries.integrity import check_integrity, numerical_rank
from clef_model.errors import BlazeError


def test_numerical_rank_ignores_bf16_rounding_noise():
    torch.manual_seed(0)
    weight = torch.randn(64, 128)
    u, v = torch.randn(64, 2), torch.randn(128, 2)
    delta_exact = 0.05 * u @ v.T
    stored = (weight + delta_exact).to(torch.bfloat16).float() - weight.to(torch.bfloat16).float()
    rms = float(weight.pow(2).mean().sqrt())
    assert numerical_rank(stored, rms, "BF16") == 2
    # The same rounded delta read as fp32 data would look full rank: the tolerance is what hides the noise.
    assert numerical_rank(stored, rms, "F32") > 2
    assert numerical_rank(torch.zeros(4, 4), 1.0, "BF16") == 0


def test_variant_passes_and_lists_changed_tensors(tiny_release, tmp_path):
    variant = make_variant(tiny_release, tmp_path / "variant", rank=2, relative=0.3)
    result = check_integrity(variant, tiny_release)
    assert result["passed"], result["problems"]
    assert result["joint_head_sha256"]["equal"] and result["release_code_sha256"]["equal"]
    changed = {c["name"]: c for c in result["changed_tensors"]}
    assert set(changed) == set(WRITERS)
    for entry in changed.values():
        assert entry["rank"] == 2
        assert entry["relative_change"] == pytest.approx(0.3, rel=0.05)
    assert result["identical_tensors"] == result["tensors"] - len(WRITERS)


def test_identical_copy_has_no_changes(tiny_release, tmp_path):
    copy = shutil.copytree(tiny_release, tmp_path / "copy")
    result = check_integrity(copy, tiny_release)
    assert result["passed"] and result["changed_tensors"] == []


@pytest.mark.parametrize("what", ["alter_head", "alter_code"])
def test_altered_head_or_code_fails(tiny_release, tmp_path, what):
    variant = make_variant(tiny_release, tmp_path / "variant", **{what: True})
    result = check_integrity(variant, tiny_release)
    assert not result["passed"]
    label = "joint head" if what == "alter_head" else "release code"
    assert any(label in problem for problem in result["problems"])


def test_variant_of_another_base_is_refused(tiny_release, tmp_path):
    from clef_model.fixtures import build_fixture

    other = build_fixture(tmp_path / "other", "tiny", num_layers=4, seed=3)
    with pytest.raises(BlazeError, match="not a variant"):
        check_integrity(other, tiny_release)


def test_manifest_naming_another_base_is_refused(tiny_release, tmp_path):
    manifest = {"blaze_manifest": 1, "base": {"ref": "elsewhere", "index_sha256": "0" * 64}}
    variant = make_variant(tiny_release, tmp_path / "variant", manifest=manifest)
    with pytest.raises(BlazeError, match="another base"):
        check_integrity(variant, tiny_release)


def test_manifest_tensor_hashes_of_another_base_are_refused(tiny_release, tmp_path):
    manifest = {"blaze_manifest": 1, "base": {"tensor_sha256": {WRITERS[0].removesuffix(".weight"): "f" * 64}}}
    variant = make_variant(tiny_release, tmp_path / "variant", manifest=manifest)
    with pytest.raises(BlazeError, match="another base"):
        check_integrity(variant, tiny_release)
    assert json.loads((variant / "blaze_manifest.json").read_text())["base"]


def test_added_report_files_are_allowed_changed_side_files_are_not(tiny_release, tmp_path):
    variant = make_variant(tiny_release, tmp_path / "variant")
    (variant / "blaze_canary.json").write_text("{}")
    result = check_integrity(variant, tiny_release)
    assert result["passed"] and result["added_files"] == ["blaze_canary.json"]
    config = variant / "generation_config.json"
    config.write_text(config.read_text().replace("{", '{"do_sample": true, ', 1))
    result = check_integrity(variant, tiny_release)
    assert not result["passed"] and "side file generation_config.json differs from the base" in result["problems"]


def test_variant_written_by_surgery_passes_with_its_manifest(tiny_release, tmp_path):
    from clef_model.release import resolve_release
    from surgery.patch import Patch, base_identity
    from surgery.write import write_variant

    base = resolve_release(tiny_release)
    name = WRITERS[0].removesuffix(".weight")
    torch.manual_seed(0)
    patch = Patch({name: (0.05 * torch.randn(64, 2), 0.05 * torch.randn(128, 2))}, base_identity(base, [name]))
    variant = write_variant(base, patch, tmp_path / "variant", progress=False)
    result = check_integrity(variant, tiny_release)
    assert result["passed"], result["problems"]
    assert [(c["name"], c["rank"]) for c in result["changed_tensors"]] == [(WRITERS[0], 2)]


def test_side_file_integrity_from_the_manifest_alone():
    from canaries.integrity import side_file_integrity
    from clef_model.manifest import BaseInfo, Manifest, OutputInfo, freeze

    base = {"config.json": "a" * 64, "joint_head.safetensors": "b" * 64, "joint_schema_model.py": "c" * 64,
            "model-00001-of-00001.safetensors": "d" * 64, "README.md": "e" * 64}
    same = Manifest(base=BaseInfo(files=freeze(base)),
                    output=OutputInfo(files=freeze({**base, "model-00001-of-00001.safetensors": "f" * 64})))
    assert side_file_integrity(same) == (True, [])  # weights and the card may differ
    changed = Manifest(base=same.base, output=OutputInfo(files=freeze({**base, "config.json": "0" * 64})))
    assert side_file_integrity(changed) == (False, ["config.json: differs from the base's (SHA-256)"])
    missing = Manifest(base=same.base, output=OutputInfo(files=freeze(
        {k: v for k, v in base.items() if k != "joint_schema_model.py"})))
    ok, problems = side_file_integrity(missing)
    assert not ok and "joint_schema_model.py: in the base but not in the variant" in problems
    assert side_file_integrity(Manifest())[0] is False
