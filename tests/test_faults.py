"""The standing fault suite (issue 14): killed runs, a full disk, damaged release files, fuzzed requests.

Every case must end in a clean outcome of the exit-code contract: 0 (ok) or 2 (bad input, refused), with
one `error:` line and no traceback; never 3 (internal error) and never 1 (a gate verdict). Killed runs
must leave nothing that looks complete, and the next run must succeed and clean up after them.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clef_model.checkpoint import INDEX_NAME
from clef_model.outputs import MARKER
from clef_model.release import resolve_release
from surgery.delta import PATCH_FILE
from surgery.manifest import verify_manifest
from variants.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Internal-error logs and caches of these tests go to a private folder."""
    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "blaze-cache"))


@pytest.fixture(scope="module")
def patch_file(tiny_release, tmp_path_factory) -> Path:
    """A rank-1 patch of two matrices of the tiny release, with its base identity."""
    from test_apply import _patch

    path = tmp_path_factory.mktemp("patch") / PATCH_FILE
    _patch(resolve_release(tiny_release)).save(path)
    return path


def _clean(result, allowed=(0, 2)) -> None:
    """The exit-code contract: an allowed code, no traceback, an `error:` line when refused."""
    assert result.exit_code in allowed, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    if result.exit_code == 2:
        assert "error:" in result.output


# -- killed runs -------------------------------------------------------------------------------------------
_SLOW_WRITER = """
import sys, time
from pathlib import Path
import surgery.write as write
from clef_model.checkpoint import INDEX_NAME
copy = write.copy_file
def slow_copy(src, dst):  # side files are copied after every shard: this stretches the end of the write
    time.sleep(0.4)
    if (Path(dst).parent / INDEX_NAME).is_file():  # "shards written": hold until the test's signal arrives
        time.sleep(120)
    copy(src, dst)
write.copy_file = slow_copy
from variants.cli import main
main(sys.argv[1:], prog_name="blaze")
"""


def _spawn(args: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "BLAZE_QUIET": "1", "HF_HUB_OFFLINE": "1", "BLAZE_CACHE": str(tmp_path / "blaze-cache"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(process: subprocess.Popen, parent: Path, stage: str, timeout: float = 120.0) -> Path:
    """Poll until the run's temporary folder reaches `stage` ("created" / "shards written"); returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for folder in parent.glob(".out.tmp-*"):
            if (stage == "created" and (folder / MARKER).is_file()) or (folder / INDEX_NAME).is_file():
                return folder
        if process.poll() is not None:
            raise AssertionError(f"the run ended before {stage}: {process.stdout.read().decode()}")
        time.sleep(0.02)
    process.kill()
    raise AssertionError(f"no temporary folder reached {stage} in {timeout} s")


@pytest.mark.parametrize("stage", ["created", "shards written"])
def test_apply_killed_with_sigkill_then_rerun(tiny_release, patch_file, tmp_path, stage):
    before = _tree(tiny_release)
    out = tmp_path / "out"
    process = _spawn(["apply", str(patch_file), "--base", str(tiny_release), "--out", str(out)], tmp_path)
    _wait_for(process, tmp_path, stage)
    process.kill()
    process.wait(timeout=30)
    assert not out.exists()  # nothing under the final name: no output that looks complete
    assert _leftovers(tmp_path)  # what kill -9 leaves (a hidden, marked temporary folder)
    result = CliRunner().invoke(main, ["apply", str(patch_file), "--base", str(tiny_release), "--out", str(out)])
    _clean(result, allowed=(0,))
    assert _leftovers(tmp_path) == []  # the rerun removed the dead run's folder
    assert verify_manifest(out) == []
    assert _tree(tiny_release) == before


def test_apply_sigterm_cleans_up_at_once(tiny_release, patch_file, tmp_path):
    out = tmp_path / "out"
    process = _spawn(["apply", str(patch_file), "--base", str(tiny_release), "--out", str(out)], tmp_path)
    _wait_for(process, tmp_path, "shards written")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_edit_killed_with_sigkill_then_rerun(tiny_release, tmp_path):
    from faults_support import small_spec

    before = _tree(tiny_release)
    spec = small_spec(tmp_path)
    out = tmp_path / "out"
    args = ["edit", "--behavior", str(spec), "--out", str(out), "--base", str(tiny_release), "--no-canary",
            "--device", "cpu", "--strength", "0.1"]
    process = _spawn(args, tmp_path)
    _wait_for(process, tmp_path, "shards written", timeout=300)
    process.kill()
    process.wait(timeout=30)
    assert not out.exists() and _leftovers(tmp_path)
    result = CliRunner().invoke(main, args)
    _clean(result, allowed=(0,))
    assert _leftovers(tmp_path) == [] and verify_manifest(out) == []
    assert _tree(tiny_release) == before


# -- a full disk -------------------------------------------------------------------------------------------
def test_no_space_left_during_a_write(tiny_release, patch_file, tmp_path, monkeypatch):
    import surgery.write as write

    calls = []

    def full_disk(*args, **kwargs):
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(write, "copy_range", full_disk)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["apply", str(patch_file), "--base", str(tiny_release), "--out", str(out)])
    assert calls
    _clean(result, allowed=(2,))
    assert "no space left on device at" in result.output and " GB" in result.output and "free " in result.output
    assert not out.exists() and _leftovers(tmp_path) == []


# -- damaged release files ---------------------------------------------------------------------------------
def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _bit_flip(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    return bytes(flipped)


def _garbage_header(data: bytes) -> bytes:
    noise = hashlib.sha256(b"blaze fault suite").digest() * 4  # 128 fixed, non-UTF-8-safe bytes
    return noise[: min(len(noise), len(data))] + data[len(noise):]


DAMAGE = {"truncated": _truncate, "bit-flipped": _bit_flip, "garbage header": _garbage_header}
TINY_FILES = ["LICENSE", "chat_template.jinja", "config.json", "generation_config.json", "joint_head.safetensors",
              "joint_head_config.json", "joint_schema_model.py", "model-00001-of-00005.safetensors",
              "model-00003-of-00005.safetensors", INDEX_NAME, "processor_config.json", "tokenizer.json",
              "tokenizer_config.json"]


def _damaged(tiny_release: Path, tmp_path: Path, name: str, damage: str) -> Path:
    base = tmp_path / "base"
    shutil.copytree(tiny_release, base)
    target = base / name
    target.write_bytes(DAMAGE[damage](target.read_bytes()))
    return base


def test_fault_suite_covers_every_file_of_the_fixture(tiny_release):
    shards = sorted(p.name for p in tiny_release.glob("model-*.safetensors"))
    assert set(TINY_FILES) | set(shards) == {p.name for p in tiny_release.iterdir() if not p.name.startswith(".")}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("name", TINY_FILES)
def test_damaged_release_through_systemone(tiny_release, tmp_path, name, damage):
    base = _damaged(tiny_release, tmp_path, name, damage)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "m", "state": "hi", "questions": {"q": {"type": "noul"}}}))
    result = CliRunner().invoke(main, ["systemone", str(base), str(request), "--device", "cpu"])
    _clean(result)
    if name.endswith(".safetensors") and damage != "bit-flipped":
        assert result.exit_code == 2 and name in result.output and "re-download" in result.output


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
@pytest.mark.parametrize("name", ["model-00003-of-00005.safetensors", "chat_template.jinja", "tokenizer.json",
                                  "config.json", "generation_config.json"])
def test_damaged_release_through_generate(tiny_release, tmp_path, name, damage):
    base = _damaged(tiny_release, tmp_path, name, damage)
    result = CliRunner().invoke(main, ["generate", str(base), "Hi", "--max-new-tokens", "2", "--device", "cpu"])
    _clean(result)
    if name.endswith(".safetensors"):
        assert result.exit_code == 2 and name in result.output and "re-download" in result.output


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("name", TINY_FILES + ["model-00002-of-00005.safetensors"])
def test_damaged_release_through_apply(tiny_release, patch_file, tmp_path, name, damage):
    base = _damaged(tiny_release, tmp_path, name, damage)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["apply", str(patch_file), "--base", str(base), "--out", str(out)])
    _clean(result)
    if result.exit_code == 0:
        assert verify_manifest(out) == []
    else:
        assert not out.exists() and _leftovers(tmp_path) == []


# -- SystemOne request validation, fuzzed ------------------------------------------------------------------
_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
_json = st.recursive(_scalars, lambda children: st.lists(children, max_size=3)
                     | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=8)
_question = st.fixed_dictionaries(
    {"type": st.sampled_from(["noul", "choice", "score", "Choice", ""]) | _json},
    optional={"criteria": _json | st.dictionaries(st.sampled_from(["true", "false", "a", "b"]), _json, max_size=3)
              | st.lists(_json, max_size=4) | st.text(max_size=8),
              "instructions": _json})
_request = st.fixed_dictionaries(
    {}, optional={"model": st.text(max_size=8) | _json, "state": _json,
                  "questions": st.dictionaries(st.text(max_size=6), _question | _json, max_size=3)
                  | st.lists(_question, max_size=2) | _json,
                  "id": _json})

_valid_question = (
    st.fixed_dictionaries({"type": st.just("noul")},
                          optional={"criteria": st.dictionaries(st.sampled_from(["true", "false"]), _json),
                                    "instructions": _json})
    | st.fixed_dictionaries({"type": st.just("choice"),
                             "criteria": st.dictionaries(st.text(max_size=6), _json, min_size=1, max_size=4)},
                            optional={"instructions": _json})
    | st.fixed_dictionaries({"type": st.just("score"), "criteria": st.lists(_json, min_size=1, max_size=4)},
                            optional={"instructions": _json}))
# mostly well-formed requests with one thing at a time going wrong, so both outcomes are well exercised
_near_valid = st.fixed_dictionaries(
    {"model": st.text(max_size=8), "state": _json,
     "questions": st.dictionaries(st.text(max_size=6), _valid_question, min_size=1, max_size=3)
     | st.dictionaries(st.text(max_size=6), _valid_question | _question, min_size=1, max_size=3)},
    optional={"id": _json})


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_near_valid | _request | _json)
def test_request_validation_fuzzed(tiny_runtime, request):
    """≥ 500 generated requests: each is refused with the clean RequestError, or encodes without error."""
    from clef_model.runtime import RequestError, validate_request

    try:
        validate_request(request)
    except RequestError as error:
        assert str(error)
        event("refused")
        return
    tiny_runtime.encode_requests([request])  # what validation let through, the release's encoder accepts
    event("encoded")
