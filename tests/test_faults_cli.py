"""The exit-code contract at the top of the CLI (issue 14): 0 ok, 1 gate failed, 2 bad input or refused,
3 internal error with one line and a log; `--debug` shows the traceback. Plus the inputs that used to give
raw tracebacks: malformed requests, a NaN joint head, an unwritable --out, a cut state."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from variants.cli import main


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "blaze-cache"))


@pytest.fixture
def broken_command(monkeypatch):
    """`blaze fixture` with a bug inside: an unexpected exception deep in the code."""
    import clef_model.fixtures as fixtures

    def bug(*args, **kwargs):
        return {}["missing key"]

    monkeypatch.setattr(fixtures, "build_fixture", bug)


def test_internal_error_is_one_line_with_a_log(broken_command, tmp_path):
    result = CliRunner().invoke(main, ["fixture", str(tmp_path / "fx")])
    assert result.exit_code == 3
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("internal error: KeyError") and "--debug" in lines[0]
    log = Path(lines[0].split("full log: ")[1].split(". This")[0])
    assert log.parent == tmp_path / "blaze-cache" / "logs"
    text = log.read_text()
    assert "Traceback" in text and "KeyError: 'missing key'" in text and "fixture" in text.splitlines()[0]


def test_debug_shows_the_traceback(broken_command, tmp_path):
    result = CliRunner().invoke(main, ["--debug", "fixture", str(tmp_path / "fx")])
    assert result.exit_code == 3
    assert "Traceback" in result.output and "KeyError: 'missing key'" in result.output


def test_bad_input_and_usage_errors_exit_2(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["systemone", str(tmp_path / "nowhere"), "-"], input="{}")
    assert result.exit_code == 2 and result.output.startswith("error:") and "Traceback" not in result.output
    assert runner.invoke(main, ["apply"]).exit_code == 2  # click usage error
    assert runner.invoke(main, ["--help"]).exit_code == 0


@pytest.mark.parametrize(("request_body", "expected"), [
    ({"model": "m", "state": "s", "questions": [{"type": "noul"}]}, "questions: must be an object"),
    ({"model": "m", "state": "s", "questions": {"q1": {"type": "choice", "criteria": "yes or no"}}},
     "questions.q1.criteria: must be an object mapping option ids"),
    ({"model": "m", "state": "s", "questions": {"q1": {"type": "score", "criteria": "1-5"}}},
     "questions.q1.criteria: must be a list"),
    ({"model": "m", "state": "s", "questions": {}}, "at least one question is required"),
])
def test_malformed_requests_name_the_field(tiny_release, tmp_path, request_body, expected):
    request = tmp_path / "request.json"
    request.write_text(json.dumps(request_body))
    result = CliRunner().invoke(main, ["systemone", str(tiny_release), str(request), "--device", "cpu"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert expected in result.output, result.output


def test_nan_joint_head_is_refused_with_exit_2(tiny_release, tmp_path):
    """A variant whose joint head holds NaN: the canary refuses it as bad input (exit 2) and names the file —
    not a crash, and not a gate verdict."""
    import numpy as np

    from clef_model.checkpoint import load_arrays, save_tensors

    variant = tmp_path / "variant"
    shutil.copytree(tiny_release, variant)
    arrays, metadata = load_arrays(variant / "joint_head.safetensors")
    name = next(n for n, a in arrays.items() if a.dtype.kind == "f" or "float" in str(a.dtype))
    poisoned = arrays[name].astype(np.float32)
    poisoned.reshape(-1)[0] = np.nan
    arrays[name] = poisoned.astype(arrays[name].dtype)
    save_tensors(variant / "joint_head.safetensors", arrays, metadata)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "What is 2+2?", "keywords": ["4"]}) + "\n")
    result = CliRunner().invoke(main, ["canary", str(variant), "--against", str(tiny_release), "--suite", str(chat),
                                       "--max-new-tokens", "2", "--damage-tokens", "2", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "joint_head.safetensors" in result.output and "NaN" in result.output and "Traceback" not in result.output


def test_read_only_out_is_refused_before_any_compute(tiny_release, tmp_path, monkeypatch):
    """`blaze edit` into a place that cannot be written fails at once (exit 2), before the model loads."""
    from faults_support import small_spec

    from clef_model import outputs
    from clef_model.runtime import Runtime

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    def no_compute(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(outputs.tempfile, "mkdtemp", read_only)
    monkeypatch.setattr(Runtime, "load", no_compute)
    result = CliRunner().invoke(main, ["edit", "--behavior", str(small_spec(tmp_path)), "--out",
                                       str(tmp_path / "ro" / "variant"), "--base", str(tiny_release), "--no-canary",
                                       "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "cannot write" in result.output and "Read-only" in result.output


def test_a_cut_state_is_warned_about(tiny_runtime, capsys):
    request = {"model": "m", "state": "word " * 2000, "questions": {"q": {"type": "noul"}}}
    before = len(tiny_runtime.warnings)
    tiny_runtime.encode_requests([request], max_length=512)
    err = capsys.readouterr().err
    assert "warning: request 0: its state is" in err and "only the first" in err
    assert len(tiny_runtime.warnings) == before + 1
    tiny_runtime.encode_requests([{**request, "state": "short"}], max_length=512)
    assert "warning" not in capsys.readouterr().err and len(tiny_runtime.warnings) == before + 1
