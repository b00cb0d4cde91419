"""Security properties (issue 14): release code runs from its checked bytes only, a base is never written to,
junk never travels into a variant, and blaze's caches never unpickle."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import py_compile
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from clef_model import trust
from clef_model.trust import RELEASE_CODE_FILE, import_release_code_file
from surgery.manifest import verify_manifest


def _tree_hashes(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under `folder`, hidden files and bytecode included (anything written shows)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _plant_bytecode(release: Path, tmp_path: Path) -> Path:
    """A `.pyc` compiled from a changed copy of the release code, where Python's import system looks for it
    (unchecked-hash invalidation: Python runs it without comparing it with the source)."""
    changed = tmp_path / RELEASE_CODE_FILE
    changed.write_text((release / RELEASE_CODE_FILE).read_text() + "\nPLANTED = 'the changed code ran'\n")
    source = release / RELEASE_CODE_FILE
    target = Path(importlib.util.cache_from_source(str(source)))
    target.parent.mkdir(exist_ok=True)
    py_compile.compile(str(changed), cfile=str(target), dfile=str(source), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    return target


def test_planted_bytecode_does_not_run(tiny_release, tmp_path):
    release = tmp_path / "release"
    shutil.copytree(tiny_release, release)
    _plant_bytecode(release, tmp_path / "")
    # the plant is effective: Python's own path import runs the changed code instead of the checked source
    spec = importlib.util.spec_from_file_location("_planted_probe", release / RELEASE_CODE_FILE)
    probe = importlib.util.module_from_spec(spec)
    sys.modules["_planted_probe"] = probe
    try:
        spec.loader.exec_module(probe)
    finally:
        del sys.modules["_planted_probe"]
    assert getattr(probe, "PLANTED", None) == "the changed code ran"
    # blaze runs the bytes it checked
    module = import_release_code_file(release / RELEASE_CODE_FILE)
    assert not hasattr(module, "PLANTED")
    assert hasattr(module, "load_release_model") and module.__file__ == str((release / RELEASE_CODE_FILE).resolve())


def test_planted_bytecode_does_not_run_through_systemone(tiny_release, tmp_path):
    """The issue's reproduction: `blaze systemone RELEASE request.json` with a planted `.pyc`."""
    from variants.cli import main

    release = tmp_path / "release"
    shutil.copytree(tiny_release, release)
    # the changed copy makes systemone's answer unmistakable
    changed = tmp_path / "changed"
    changed.mkdir()
    (changed / RELEASE_CODE_FILE).write_text((release / RELEASE_CODE_FILE).read_text() + (
        "\ndef systemone_answer(question, probabilities):\n    return {'type': 'PLANTED'}\n"))
    target = Path(importlib.util.cache_from_source(str(release / RELEASE_CODE_FILE)))
    target.parent.mkdir(exist_ok=True)
    py_compile.compile(str(changed / RELEASE_CODE_FILE), cfile=str(target), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "clef-flash", "state": {"x": 1},
                                   "questions": {"q": {"type": "noul", "instructions": "Is x one?"}}}))
    result = CliRunner().invoke(main, ["systemone", str(release), str(request), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "PLANTED" not in result.output and '"noul"' in result.output


@pytest.fixture
def bytecode_on(monkeypatch):
    """Python writes bytecode (the default for users; the test runner may have it switched off)."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(trust, "_loaded", {})  # import the release code again, for this release
    return True


def test_running_a_base_leaves_it_byte_identical(tiny_release, tmp_path, bytecode_on, monkeypatch):
    """systemone, generate, edit and canary on a base, with bytecode writing on: not one byte of it changes,
    and no file appears in it (no `__pycache__`)."""
    from faults_support import small_spec

    from variants.cli import main

    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    shutil.copytree(tiny_release, base)
    before = _tree_hashes(base)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "clef-flash", "state": "hello",
                                   "questions": {"q": {"type": "choice", "criteria": {"a": "A", "b": "B"}}}}))
    runner = CliRunner()
    spec = small_spec(tmp_path)
    runs = {
        "systemone": ["systemone", str(base), str(request), "--device", "cpu"],
        "generate": ["generate", str(base), "Hello", "--max-new-tokens", "3", "--device", "cpu"],
        "edit": ["edit", "--behavior", str(spec), "--out", str(tmp_path / "variant"), "--base",
                 str(base), "--no-canary", "--device", "cpu", "--strength", "0.1",
                 "--cache-dir", str(tmp_path / "stats")],
    }
    for name, args in runs.items():
        result = runner.invoke(main, args)
        assert result.exit_code == 0, (name, result.output)
        assert _tree_hashes(base) == before, name
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "What is 2+2?", "keywords": ["4"]}) + "\n")
    result = runner.invoke(main, ["canary", str(tmp_path / "variant"), "--against", str(base), "--behavior", str(spec),
                                  "--suite", str(chat),
                                  "--max-new-tokens", "3", "--damage-tokens", "3", "--device", "cpu"])
    assert result.exit_code in (0, 1), result.output  # a verdict either way, not a crash
    assert _tree_hashes(base) == before
    assert not list(base.rglob("__pycache__"))


JUNK = ["__pycache__/joint_schema_model.cpython-312.pyc", ".DS_Store", "config.json~", "notes.txt.swp",
        "extra/.DS_Store", "chat_template.jinja.bak", "#config.json#", "Thumbs.db"]


def test_junk_files_stay_out_of_variants_and_manifests(tiny_release, tmp_path):
    """__pycache__, .DS_Store, editor backups in a base are neither copied into a variant nor listed."""
    from test_apply import _patch

    from clef_model.release import is_junk, resolve_release
    from surgery.apply import apply_patch

    base = tmp_path / "base"
    shutil.copytree(tiny_release, base)
    for name in JUNK:
        (base / name).parent.mkdir(parents=True, exist_ok=True)
        (base / name).write_bytes(b"junk")
    (base / "extra" / "notes.md").write_text("a real side file")  # kept: not junk
    assert all(is_junk(name) for name in JUNK) and not is_junk("extra/notes.md")
    release = resolve_release(base)
    assert not set(JUNK) & set(release.side_files()) and "extra/notes.md" in release.side_files()
    patch = _patch(release)
    patch_file = tmp_path / "delta.safetensors"
    patch.save(patch_file)
    result = apply_patch(patch_file, tmp_path / "variant", base=str(base))
    variant = result.out
    files = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()}
    assert not files & set(JUNK) and "extra/notes.md" in files
    manifest = json.loads((variant / "blaze_manifest.json").read_text())  # the file as published
    assert not set(manifest["base"]["files"]) & set(JUNK) and not set(manifest["output"]["files"]) & set(JUNK)
    assert verify_manifest(variant) == []


def test_canary_disk_cache_does_not_unpickle(tmp_path):
    """A cache file holding a pickle that runs code when loaded is ignored (recomputed), never executed."""
    import torch

    from canaries.cache import DiskCache

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (marker, "code ran"))

    cache = DiskCache(tmp_path / "canary")
    cache.folder.mkdir()
    torch.save({"outputs": Payload()}, cache._path("k" * 64))
    assert cache.get("k" * 64) is None
    assert not marker.exists()
    value = {"freeform": [{"prompt": "hi", "text": "hello", "tokens": [1, 2]}], "kl": 0.5,
             "logits": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    cache.put("v" * 64, value)
    back = cache.get("v" * 64)
    assert back["freeform"] == value["freeform"] and torch.equal(back["logits"], value["logits"])
