"""Property-based fuzzing of behaviour-spec validation (issue 14, the standing fault suite).

Inputs are mostly near-valid: a shipped spec (trimmed to a few items per list so every section is hit
often) with one to three fields mutated: a wrong type, NaN/±inf, a negative or huge number, an empty list,
a huge string, an unknown key, a deleted key, a duplicated list entry. So most inputs pass the outer
checks and reach the deep ones (chat prompts, stances, defaults, gate bounds). Whatever the input,
`parse_behavior`, `load_behavior(FILE)`, `blaze behaviors show FILE` and `blaze edit --behavior FILE` end in
a parsed spec or a clean `SpecError`/`BlazeError` (exit 2), never another exception or a traceback.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from clef_model.errors import BlazeError
from variants.cli import main
from variants.spec import (
    NAME_PATTERN,
    BehaviorSpec,
    behaviors_dir,
    list_behaviors,
    load_behavior,
    parse_behavior,
)

KEEP = 3  # items kept per list of a shipped spec


def _trim(value: Any) -> Any:
    """A shipped spec with every list cut to its first KEEP items (chat prompts kept whole: they end with a user)."""
    if isinstance(value, dict):
        return {key: _trim(item) for key, item in value.items()}
    if isinstance(value, list) and not (value and isinstance(value[0], dict) and "role" in value[0]):
        return [_trim(item) for item in value[:KEEP]]
    return value


SHIPPED = [_trim(json.loads((behaviors_dir() / f"{name}.json").read_text(encoding="utf-8")))
           for name in list_behaviors()]
HUGE = "x" * 200_000
LONG_INT = "<an integer of 5000 digits>"  # a file holds it written out (Python's json refuses > 4300 digits)
HOSTILE: list[Any] = [None, True, False, 0, -1, 1, 2**70, -(2**70), 10**400, -(10**400), 0.5, -0.5, 1e308, -1e308, math.nan, math.inf,
                      -math.inf, "", " ", "auto", "steer", "user", "pushback", HUGE, "\x00", "é" * 50, LONG_INT, [], [None],
                      [""], [1, 2], [[]], [{}], {}, {"role": "user"}, {"role": "user", "content": "hi"},
                      {"unknown": 1}]
DEEP_WEIGHT = {"directions": 8, "heldout": 4, "defaults": 4, "gate": 3, "preserve": 2}
VALUES = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12), st.integers(-10, 10**6),
                   st.floats(allow_nan=True, allow_infinity=True)).map(copy.deepcopy)  # never share a list


@st.composite
def mutated_specs(draw: st.DrawFn) -> Any:
    """A shipped spec with 1-3 mutations, each at a path drawn by walking the tree from the root."""
    data = copy.deepcopy(draw(st.sampled_from(SHIPPED)))
    if draw(st.integers(0, 99)) == 0:
        return draw(VALUES)  # now and then the whole spec is not an object
    for _ in range(draw(st.integers(1, 3))):
        parent, key, node, depth = None, None, data, 0
        while isinstance(node, (dict, list)) and node and not (depth >= 2 and draw(st.integers(0, 3)) == 0):
            if depth == 0:  # the sections with nested fields are walked into most often
                key = draw(st.sampled_from([k for k in node for _ in range(DEEP_WEIGHT.get(k, 1))]))
            else:
                key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            parent, node, depth = node, node[key], depth + 1
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "unknown", "empty", "duplicate"]))
        if parent is None:
            break  # the spec is empty (an earlier mutation): nothing left to walk into
        if action == "replace":
            parent[key] = draw(VALUES)
        elif action == "delete":
            del parent[key]
        elif action == "unknown" and isinstance(parent, dict):
            parent[draw(st.sampled_from(["extra", "Name", "", HUGE[:1000], "prompt"]))] = draw(VALUES)
        elif action == "empty" and isinstance(parent, (dict, list)):
            parent[key] = [] if isinstance(node, list) or draw(st.booleans()) else {}
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(node))
        else:
            parent[key] = draw(VALUES)
    return data


def _depth(error: BlazeError) -> str:
    """'deep' when a problem names a field inside a section (a dot or an index: the validator reached the
    nested checks; it reports every problem, so a top-level one beside it does not stop them), else 'shallow'."""
    fields = [line.strip().split(":")[0] for line in str(error).splitlines()[1:]]
    return "deep" if any("." in f or "[" in f for f in fields) else "shallow"


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_specs())
def test_parse_behavior_fuzzed(data: Any):
    try:
        spec = parse_behavior(data)
    except BlazeError as error:  # SpecError is a BlazeError; anything else fails the test with its traceback
        assert str(error).strip()
        event(f"refused ({_depth(error)})")
        return
    assert isinstance(spec, BehaviorSpec)
    event("accepted")
    spec.to_contrast_pairs(), spec.validation_items(), spec.heldout_items(), spec.preserve_prompts()
    spec.defaults.to_dict(), spec.gate.to_dict()


def _spec_file(folder: Path, data: Any) -> Path:
    """The spec as a JSON file named after its name when that is a valid name (NaN/Infinity written as JSON5-ish
    tokens, which Python's json module reads back: a hand-edited file can hold them)."""
    name = data.get("name") if isinstance(data, dict) else None
    stem = name if isinstance(name, str) and NAME_PATTERN.match(name) and len(name) < 100 else "fuzzed"
    path = folder / f"{stem}.json"
    text = json.dumps(data, allow_nan=True).replace(json.dumps(LONG_INT), "1" + "0" * 4999)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def spec_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzzed-specs")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
@given(mutated_specs())
def test_spec_file_fuzzed_through_the_cli(spec_folder: Path, data: Any):
    path = _spec_file(spec_folder, data)
    try:
        try:
            load_behavior(path)
            loads = True
        except BlazeError:
            loads = False
        shown = CliRunner().invoke(main, ["behaviors", "show", str(path)])
        assert shown.exit_code == (0 if loads else 2), shown.output
        assert "Traceback" not in shown.output and "internal error" not in shown.output, shown.output
        # `blaze edit` loads the spec, builds the contrast pairs and edit settings, then fails on the missing base
        edit = CliRunner().invoke(main, ["edit", "--behavior", str(path), "--out", str(spec_folder / "out"),
                                         "--base", str(spec_folder / "no-such-base"), "--no-canary"])
        assert edit.exit_code == 2, edit.output
        assert "Traceback" not in edit.output and "internal error" not in edit.output, edit.output
        event("spec loads" if loads else "spec refused")
        if loads:
            assert "no-such-base" in edit.output or "--rank" in edit.output, edit.output  # the spec passed
    finally:
        path.unlink()
