"""`clef_model.env`: one parse rule for switches, `~` expanded in BLAZE_CACHE, read at call time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from clef_model import env
from clef_model.errors import BlazeError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), (" Yes ", True), ("ON", True),
    ("0", False), ("false", False), ("no", False), ("Off", False),
])
def test_one_rule_for_switches(monkeypatch, value, expected):
    for name, read in ((env.QUIET, env.quiet), (env.FAST_COMPILE, env.fast_compile), (env.HASH_CACHE, env.hash_cache)):
        monkeypatch.setenv(name, value)
        assert read() is expected, name
    monkeypatch.setenv(env.FAST, value)
    assert env.fast() is expected


def test_defaults_when_unset_or_empty(monkeypatch):
    for name in (env.QUIET, env.FAST, env.FAST_COMPILE, env.HASH_CACHE, env.CACHE, env.FAST_HEAD,
                 env.STATS_CACHE_MAX_GB):
        monkeypatch.delenv(name, raising=False)
    assert env.quiet() is False and env.fast() is None and env.fast_compile() is False and env.hash_cache() is True
    assert env.cache_root() == Path.home() / ".cache" / "blaze"
    assert env.fast_head() == "" and env.stats_cache_max_bytes() == 2e9
    monkeypatch.setenv(env.QUIET, "")
    monkeypatch.setenv(env.HASH_CACHE, "  ")
    assert env.quiet() is False and env.hash_cache() is True
    monkeypatch.setenv(env.FAST, "auto")
    assert env.fast() is None


def test_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv(env.QUIET, "maybe")
    with pytest.raises(BlazeError, match="BLAZE_QUIET='maybe' is not a switch"):
        env.quiet()
    monkeypatch.setenv(env.STATS_CACHE_MAX_GB, "lots")
    with pytest.raises(BlazeError, match="BLAZE_STATS_CACHE_MAX_GB must be a number"):
        env.stats_cache_max_bytes()
    monkeypatch.setenv(env.STATS_CACHE_MAX_GB, "0.5")
    assert env.stats_cache_max_bytes() == 5e8


def test_cache_root_expands_home_and_every_cache_uses_it(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(env.CACHE, "~/blaze-cache")
    root = tmp_path / "blaze-cache"
    assert env.cache_root() == root
    from canaries.cache import cache_root as canary_cache
    from clef_model.embedded import cache_root as embedded_cache
    from clef_model.filehash import cache_path
    from variants.cli import log_folder

    assert embedded_cache() == root and canary_cache() == root / "canary"
    assert cache_path().parent == root and log_folder() == root / "logs"


def test_the_core_variables_are_read_in_one_module():
    """BLAZE_QUIET, BLAZE_CACHE and BLAZE_FAST are read from the environment only in clef_model/env.py."""
    pattern = re.compile(r"(environ|getenv).*BLAZE_(QUIET|CACHE|FAST)\b")
    found = [f"{path.relative_to(ROOT)}:{number}" for package in ("clef_model", "surgery", "canaries", "variants")
             for path in sorted((ROOT / package).rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert found == [], found
    assert pattern.search('os.environ.get("BLAZE_QUIET")')  # the check itself can fail


def test_read_at_call_time_not_import_time(tmp_path):
    """A variable set after the import is seen (tests set them with monkeypatch)."""
    code = ("import os; from clef_model import env; before = env.quiet(); os.environ['BLAZE_QUIET'] = '1'; "
            "print(before, env.quiet())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)})
    assert out.stdout.split() == ["False", "True"], out.stderr
