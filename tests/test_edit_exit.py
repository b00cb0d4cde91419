"""`blaze edit`'s exit code follows the final canary's gate: a failed held-out gate is a verdict (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import variants.build as build
from variants.build import BuildResult
from variants.cli import main


def _fake_build(gate: dict | None):
    def fake(opts, echo):
        opts.out.mkdir(parents=True, exist_ok=True)
        canary = None if gate is None else {"gate": gate}
        return BuildResult(out=opts.out, patch=None, strength=0.3, canary=canary)
    return fake


@pytest.mark.parametrize(("gate", "code"), [
    ({"passed": True, "failed": []}, 0),
    ({"passed": False, "failed": ["loops"]}, 1),
    (None, 0),  # --no-canary: nothing was judged
])
def test_edit_exit_code_follows_the_final_gate(monkeypatch, tmp_path: Path, gate, code):
    monkeypatch.setattr(build, "build_variant", _fake_build(gate))
    out = tmp_path / "variant"
    result = CliRunner().invoke(main, ["edit", "--behavior", "verbosity", "--out", str(out), "--base", "smollm2"])
    assert result.exit_code == code, result.output
    assert out.is_dir()  # the variant is kept either way, for inspection
    if code == 1:
        assert "final canary FAILED (loops)" in result.output
