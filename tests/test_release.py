"""Release resolution, layout validation and trust of release code."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from clef_model.errors import ReleaseError, UntrustedCodeError
from clef_model.release import Release, resolve_release
from clef_model.runtime import Runtime
from clef_model.trust import KNOWN_RELEASE_CODE, load_release_code


def copy_release(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_local_folder_resolves_as_clef(tiny_release: Path) -> None:
    release = resolve_release(tiny_release)
    assert isinstance(release, Release)
    assert (release.kind, release.architecture, release.revision) == ("clef", "qwen3_5", None)
    weight_map = release.weight_map()
    assert "lm_head.weight" in weight_map and any(name.startswith("mtp.") for name in weight_map)
    side = release.side_files()
    assert "joint_head.safetensors" in side and "joint_schema_model.py" in side and "config.json" in side
    assert not any(name.startswith("model-") for name in side) and "model.safetensors.index.json" not in side


def test_missing_shard_is_a_clear_error(tiny_release: Path, tmp_path: Path) -> None:
    broken = copy_release(tiny_release, tmp_path / "broken")
    shard = sorted(set(resolve_release(broken).weight_map().values()))[1]
    (broken / shard).unlink()
    (broken / "joint_head.safetensors").unlink()
    with pytest.raises(ReleaseError) as info:
        resolve_release(broken)
    message = str(info.value)
    assert shard in message and "joint_head.safetensors" in message
    assert "missing" in message
    with pytest.raises(ReleaseError, match=shard):
        Runtime.load(str(broken), device="cpu")


def test_missing_processor_and_template_listed(tiny_release: Path, tmp_path: Path) -> None:
    broken = copy_release(tiny_release, tmp_path / "broken")
    (broken / "processor_config.json").unlink()
    (broken / "chat_template.jinja").unlink()
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ReleaseError) as info:
        resolve_release(broken)
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert name in str(info.value)


def test_hub_id_while_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ReleaseError) as info:
        resolve_release("Cloudflare/clef-flash", revision="17f0b0ad64efb65d273590632833508766b2aae6")
    message = str(info.value)
    assert "Cloudflare/clef-flash" in message and "HF_HUB_OFFLINE" in message
    assert "local folder" in message


def test_nonsense_reference_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match="neither a folder nor a Hub id"):
        resolve_release(str(tmp_path / "does" / "not" / "exist"))


def test_changed_release_code_needs_opt_in(tiny_release: Path, tmp_path: Path) -> None:
    changed = copy_release(tiny_release, tmp_path / "changed")
    code = changed / "joint_schema_model.py"
    code.write_text(code.read_text() + "\nBLAZE_TEST_MARKER = 42\n")
    release = resolve_release(changed)
    with pytest.raises(UntrustedCodeError) as info:
        load_release_code(release)
    from clef_model.checkpoint import sha256_file

    assert sha256_file(code) in str(info.value) and "--trust-release-code" in str(info.value)
    with pytest.raises(UntrustedCodeError):
        Runtime.load(str(changed), device="cpu")
    module = load_release_code(release, trust_release_code=True)
    assert module.BLAZE_TEST_MARKER == 42
    runtime = Runtime.load(str(changed), device="cpu", dtype=torch.float32, trust_release_code=True)
    assert runtime.release_code is module


def test_known_code_imports_under_unique_name_without_sys_path(tiny_release: Path) -> None:
    import sys

    before = list(sys.path)
    module = load_release_code(resolve_release(tiny_release))
    assert sys.path == before
    assert module.__name__.startswith("_blaze_release_code_")
    assert "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3" in KNOWN_RELEASE_CODE


def test_plain_causal_lm_layout(tmp_path: Path, tiny_release: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_release / name, folder / name)
    with pytest.raises(ReleaseError, match="model.safetensors"):
        resolve_release(folder)


def test_hub_id_resolves_from_the_local_hub_cache_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_release: Path
) -> None:
    commit = "17f0b0ad64efb65d273590632833508766b2aae6"
    repo = tmp_path / "hub" / "models--Cloudflare--clef-flash"
    shutil.copytree(tiny_release, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    release = resolve_release("Cloudflare/clef-flash")
    assert release.revision == commit and release.kind == "clef"
    assert release.path == repo / "snapshots" / commit
    pinned = resolve_release("Cloudflare/clef-flash", revision=commit)
    assert pinned.path == release.path
