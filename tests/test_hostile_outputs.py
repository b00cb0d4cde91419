"""Hostile or careless input found by a probe of the CLI (stop 20): an adapter folder that is, holds or lies
inside the base; a folder that only pretends to be blaze's; patch metadata of the wrong shape; inputs nested
past Python's stack; a request that is not UTF-8 or has an empty question id. Each must end in exit 2 with one
``error:`` line, leave the base byte-identical and write nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_lora import _patch

from clef_model.errors import BlazeError
from clef_model.outputs import check_separate, written_by_blaze
from clef_model.release import resolve_release
from surgery.delta import PatchArrays
from variants.cli import main


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def base_and_patch(tiny_release, tmp_path) -> tuple[Path, Path]:
    """A private copy of the tiny release (the test may try to destroy it) and a patch made on it."""
    base = tmp_path / "base"
    shutil.copytree(tiny_release, base)
    patch = _patch(resolve_release(base), layers=(1,))
    patch.save(tmp_path / "delta.safetensors")
    return base, tmp_path / "delta.safetensors"


def _apply(*args: str):
    return CliRunner().invoke(main, ["apply", *args])


@pytest.mark.parametrize("where", ["base", "inside"])
def test_apply_refuses_an_adapter_folder_on_or_in_the_base(base_and_patch, tmp_path, where):
    base, delta = base_and_patch
    before = _tree(base)
    adapter = base if where == "base" else base / "lora"
    result = _apply(str(delta), "--base", str(base), "--out", str(tmp_path / "v"), "--export-lora", str(adapter),
                    "--force")
    assert result.exit_code == 2, result.output
    assert "overlaps the base" in result.output or "not written by blaze" in result.output
    assert _tree(base) == before                        # the base was neither replaced nor written into
    assert not (tmp_path / "v").exists()                # refused before the variant was written


def test_apply_refuses_an_adapter_folder_inside_the_variant_output(base_and_patch, tmp_path):
    base, delta = base_and_patch
    result = _apply(str(delta), "--base", str(base), "--out", str(tmp_path / "v"), "--export-lora",
                    str(tmp_path / "v" / "lora"))
    assert result.exit_code == 2 and "overlaps the variant output" in result.output, result.output
    assert not (tmp_path / "v").exists()


def test_force_does_not_replace_a_folder_with_a_fake_manifest(base_and_patch, tmp_path):
    base, delta = base_and_patch
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "important.txt").write_text("precious")
    (mine / "blaze_manifest.json").write_text("garbage, not JSON")
    assert not written_by_blaze(mine)
    (mine / "blaze_manifest.json").write_text(json.dumps({"some": "object"}))
    assert not written_by_blaze(mine)                   # JSON, but not a blaze manifest
    result = _apply(str(delta), "--base", str(base), "--out", str(mine), "--force")
    assert result.exit_code == 2 and "not written by blaze" in result.output, result.output
    assert (mine / "important.txt").read_text() == "precious"
    (mine / "blaze_manifest.json").write_text(json.dumps({"blaze_manifest": 1}))
    assert written_by_blaze(mine)                       # the marker blaze writes still counts


def test_check_separate_catches_every_overlap(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for out in (tmp_path / "a", tmp_path / "a" / "b", tmp_path, tmp_path / "a" / "b" / ".." / "b"):
        with pytest.raises(BlazeError, match="overlaps"):
            check_separate(out, tmp_path / "a" / "b" if out == tmp_path / "a" else tmp_path / "a", "the base")
    check_separate(tmp_path / "c", tmp_path / "a", "the base")   # a sibling is fine


def _rewrite_metadata(delta: Path, out: Path, **changes) -> Path:
    """The patch at `delta` saved again with some safetensors metadata fields replaced (raw strings)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(delta), "np") as handle:
        meta = dict(handle.metadata())
    meta.update(changes)
    save_file(load_file(str(delta)), str(out), metadata=meta)
    return out


@pytest.mark.parametrize("field, value", [
    ("blaze_base_identity", "[1, 2]"),
    ("blaze_base_identity", json.dumps({"ref": "x", "tensor_sha256": []})),
    ("blaze_base_identity", json.dumps({"ref": "x", "tensor_sha256": "abc"})),
    ("blaze_base_identity", json.dumps({"index_sha256": 5, "tensor_sha256": {}})),
    ("blaze_base_identity", json.dumps({"ref": "x", "tensor_sha256": {"a": 5}})),
    ("blaze_metadata", "[1, 2]"),
    ("blaze_metadata", "[" * 100_000),
])
def test_patch_metadata_of_the_wrong_shape_is_bad_input(base_and_patch, tmp_path, field, value):
    base, delta = base_and_patch
    bad = _rewrite_metadata(delta, tmp_path / "bad.safetensors", **{field: value})
    with pytest.raises(BlazeError, match="patch metadata"):
        PatchArrays.load(bad)
    result = _apply(str(bad), "--base", str(base), "--out", str(tmp_path / "v"))
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "v").exists()


def test_an_identity_that_lists_no_tensors_is_refused(base_and_patch, tmp_path):
    """Before: {"ref": …} alone skipped every base check without a warning (the edited tensors unlisted)."""
    base, delta = base_and_patch
    bad = _rewrite_metadata(delta, tmp_path / "bad.safetensors", blaze_base_identity=json.dumps({"ref": str(base)}))
    result = _apply(str(bad), "--base", str(base), "--out", str(tmp_path / "v"))
    assert result.exit_code == 2 and "does not list" in result.output, result.output
    assert not (tmp_path / "v").exists()


def test_a_safetensors_header_nested_past_the_stack_is_a_damaged_file(tmp_path):
    from clef_model.checkpoint import read_header

    deep = ("[" * 100_000).encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(BlazeError, match="not JSON"):
        read_header(path)


def test_deep_or_undecodable_spec_request_and_manifest_are_bad_input(tiny_release, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    empty_id = tmp_path / "empty_id.json"
    empty_id.write_text(json.dumps({"model": "m", "state": "s", "questions": {"": {"type": "noul"}}}))
    variant = tmp_path / "variant"
    variant.mkdir()
    (variant / "blaze_manifest.json").write_text("[" * 100_000)
    runs = [
        (["behaviors", "show", str(deep)], "nests too deeply"),
        (["systemone", str(tiny_release), str(deep), "--device", "cpu"], "cannot be read as a request"),
        (["systemone", str(tiny_release), str(binary), "--device", "cpu"], "not UTF-8"),
        (["systemone", str(tiny_release), str(empty_id), "--device", "cpu"], "non-empty name"),
        (["publish", str(variant), "--repo", "me/x", "--dry-run"], "not valid JSON"),
    ]
    for args, message in runs:
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output


def test_edit_checks_its_adapter_folder_before_any_compute(tiny_release, tmp_path):
    from variants.build import BuildOptions, check_outputs

    opts = BuildOptions(behavior="verbosity", out=tmp_path / "v", export_lora=tmp_path / "v" / "lora")
    with pytest.raises(BlazeError, match="overlaps the variant output"):
        check_outputs(opts, tmp_path / "v")
    assert not (tmp_path / "v").exists()
    inside = BuildOptions(behavior="verbosity", out=tmp_path / "v", export_lora=Path(tiny_release), force=True)
    check_outputs(inside, tmp_path / "v")              # a blaze fixture may be replaced with --force …
    with pytest.raises(BlazeError, match="overlaps the base"):
        check_outputs(inside, tmp_path / "v", base=Path(tiny_release))   # … but not when it is the base


def test_edit_refuses_a_statistics_folder_inside_the_base(base_and_patch, tmp_path):
    """`--cache-dir BASE/stats` would write the statistics files into the base."""
    base, _ = base_and_patch
    before = _tree(base)
    result = CliRunner().invoke(main, ["edit", "--base", str(base), "--behavior", "verbosity", "--out",
                                       str(tmp_path / "v"), "--strength", "0.1", "--no-canary", "--device", "cpu",
                                       "--cache-dir", str(base / "stats")])
    assert result.exit_code == 2, result.output
    assert "overlaps the base" in result.output and "Traceback" not in result.output
    assert _tree(base) == before and not (tmp_path / "v").exists()


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "/etc/passwd", "a/../../x.safetensors"])
def test_an_index_naming_a_shard_outside_the_release_is_refused(base_and_patch, shard):
    from clef_model.checkpoint import CheckpointReader

    base, _ = base_and_patch
    index_path = base / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(BlazeError, match="outside the release folder"):
        CheckpointReader(base)


def test_a_bad_stats_cache_limit_is_refused(monkeypatch):
    from clef_model.env import stats_cache_max_bytes

    for value in ("nan", "-1", "inf", "lots"):
        monkeypatch.setenv("BLAZE_STATS_CACHE_MAX_GB", value)
        with pytest.raises(BlazeError, match="BLAZE_STATS_CACHE_MAX_GB"):
            stats_cache_max_bytes()
    monkeypatch.setenv("BLAZE_STATS_CACHE_MAX_GB", "0.5")
    assert stats_cache_max_bytes() == 0.5e9


@pytest.mark.parametrize("where", ["base", "inside"])
def test_a_cache_inside_the_base_is_refused_and_the_base_not_written(base_and_patch, tmp_path, monkeypatch, where):
    """BLAZE_CACHE set to the base (or a folder in it) would make apply write its hash cache into the base."""
    base, delta = base_and_patch
    before = _tree(base)
    monkeypatch.setenv("BLAZE_HASH_CACHE", "1")  # the suite turns the hash cache off; it is what would land there
    monkeypatch.setenv("BLAZE_CACHE", str(base if where == "base" else base / "cache"))
    result = _apply(str(delta), "--base", str(base), "--out", str(tmp_path / "v"))
    assert result.exit_code == 2, result.output
    assert "BLAZE_CACHE" in result.output and "Traceback" not in result.output
    assert _tree(base) == before and not (base / "cache").exists()
    assert not (tmp_path / "v").exists()
    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "cache"))  # a cache beside the base is fine
    assert _apply(str(delta), "--base", str(base), "--out", str(tmp_path / "v")).exit_code == 0
    assert _tree(base) == before


def test_a_broad_cache_root_does_not_make_every_folder_blaze_s(tmp_path, monkeypatch):
    """With BLAZE_CACHE at a home-like folder, `--force` may replace only blaze's own outputs in the cache
    (converted models, fixtures), not the user's folders under it."""
    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path))
    mine = tmp_path / "Documents"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert not written_by_blaze(mine)
    result = CliRunner().invoke(main, ["fixture", "--preset", "tiny", str(mine), "--force"])
    assert result.exit_code == 2, result.output
    assert (mine / "notes.txt").read_text() == "mine"
    converted = tmp_path / "embedded" / "some-model"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert written_by_blaze(converted)
