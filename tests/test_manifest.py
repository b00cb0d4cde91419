"""The typed `Manifest`: byte-exact JSON round trip, typed fields, versions, clear errors for bad files."""

from __future__ import annotations

import dataclasses
import json

import pytest

from clef_model.errors import BlazeError
from clef_model.files import MANIFEST_FILE
from clef_model.manifest import MANIFEST_VERSION, Manifest, ManifestError, find_manifest, read_manifest
from surgery.manifest import build_manifest, write_manifest


def _built(**edit_extra) -> Manifest:
    return build_manifest(
        base={"ref": "some/base", "revision": None, "total_size": 10, "files": {"config.json": "a" * 64},
              "index_file": "model.safetensors.index.json", "index_sha256": None,
              "tensor_sha256": {"layers.0.mlp.down_proj": "b" * 64}},
        patch_file="blaze_delta.safetensors",
        patch_metadata={"behavior": "verbosity", "targets": {"x": {"rel_change": 0.1}}},
        base_identity=None,
        edit={"behavior": "verbosity", "spec_hash": "c" * 64, "strength": 0.3, "strength_mode": "fixed",
              "method": "steer", "rank": 1, "lambda": 1.0, "layers": [2, 3], "kinds": ["mlp_down"],
              "sweep": [], "canary_gate": None, "positions": "last", **edit_extra},
        matrices={"layers.0.mlp.down_proj": {"shape": [64, 128], "dtype": "BF16", "k": 1, "numerical_rank": 1,
                                             "delta_norm": 0.5, "weight_norm": 10.0, "relative_change": 0.05,
                                             "realized_relative_change": None}},
        output_files={"model.safetensors": "d" * 64, "config.json": "a" * 64},
        output_total_size=10,
        edited_tensors=["layers.0.mlp.down_proj.weight"],
    )


def test_typed_fields_read_back():
    manifest = _built()
    assert manifest.version == MANIFEST_VERSION
    assert manifest.behavior == "verbosity" and manifest.edit.strength == 0.3 and manifest.edit.lam == 1.0
    assert manifest.edit.layers == (2, 3) and manifest.edit.kinds == ("mlp_down",)
    assert manifest.base.ref == "some/base" and manifest.base.revision is None
    assert manifest.matrices["layers.0.mlp.down_proj"].relative_change == 0.05
    assert manifest.output.files["config.json"] == "a" * 64
    assert manifest.edited_tensors == ("layers.0.mlp.down_proj.weight",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        manifest.edit.strength = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        manifest.output.files["x"] = "y"  # type: ignore[index]


def test_round_trip_is_byte_identical_and_keeps_untyped_keys(tmp_path):
    """Unknown keys (a search table, a future field) and explicit nulls survive a read and a write unchanged."""
    manifest = _built(search={"points": [{"strength": 0.1, "passed": True}], "note": None})
    text = manifest.to_json()
    again = Manifest.from_json(text)
    assert again == manifest and again.to_json() == text
    assert again.edit.extra["search"]["points"][0]["strength"] == 0.1
    assert json.loads(text)["edit"]["canary_gate"] is None and json.loads(text)["base"]["revision"] is None
    write_manifest(tmp_path / MANIFEST_FILE, again)
    assert (tmp_path / MANIFEST_FILE).read_text(encoding="utf-8") == text
    assert read_manifest(tmp_path) == manifest


def test_written_bytes_match_the_plain_json_of_the_same_content():
    """`to_json` writes what `json.dumps(sort_keys, indent=2)` of the dict gives: the version 1 file format."""
    manifest = _built()
    raw = manifest.to_dict()
    assert manifest.to_json() == json.dumps(raw, indent=2, sort_keys=True) + "\n"
    assert raw["blaze_manifest"] == 1 and set(raw) == {"blaze_manifest", "base", "patch", "edit", "matrices",
                                                      "versions", "output", "edited_tensors"}


def test_newer_or_unknown_version_is_refused():
    raw = _built().to_dict()
    with pytest.raises(ManifestError, match="newer blaze"):
        Manifest.from_dict({**raw, "blaze_manifest": MANIFEST_VERSION + 1})
    with pytest.raises(ManifestError, match="unknown manifest version"):
        Manifest.from_dict({**raw, "blaze_manifest": "one"})
    with pytest.raises(ManifestError, match="not a blaze manifest"):
        Manifest.from_dict({k: v for k, v in raw.items() if k != "blaze_manifest"})


@pytest.mark.parametrize("path, value, field", [
    (("edit", "strength"), "strong", "edit.strength"),
    (("edit", "layers"), [1, "2"], "edit.layers"),
    (("output", "files"), {"a": 1}, "output.files"),
    (("base", "ref"), 7, "base.ref"),
    (("matrices", "layers.0.mlp.down_proj", "k"), 1.5, "matrices.layers.0.mlp.down_proj.k"),
    (("edit",), [], "edit"),
])
def test_malformed_field_names_the_field(path, value, field):
    raw = _built().to_dict()
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(BlazeError, match=f"{field} must be"):
        Manifest.from_dict(raw)


def test_damaged_or_missing_file(tmp_path):
    with pytest.raises(BlazeError, match="not found"):
        read_manifest(tmp_path)
    assert find_manifest(tmp_path) is None
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(BlazeError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("[1, 2]")
    with pytest.raises(BlazeError, match="not a blaze manifest"):
        find_manifest(tmp_path)
