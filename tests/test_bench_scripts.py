"""The GPU benchmark package (scripts/bench) stays runnable: its entry point, its sections, its results.

These run on a CPU machine: they check that `python -m scripts.bench --help` works, that every section
module imports without CUDA, that the command line is checked, and that the typed results keep the key
layout of the results.json files BENCHMARKS.md quotes. The figures themselves need a GPU.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION_MODULES = ["env", "systemone", "s1batch", "generate", "decodeprof", "edit", "canary"]


@pytest.fixture
def bench_run(monkeypatch: pytest.MonkeyPatch):
    """``scripts.bench.run``, imported from the repository root."""
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("scripts.bench.run")


def test_help_runs_without_a_gpu() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "scripts.bench", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "--sections" in done.stdout
    for name in SECTION_MODULES:
        assert f"  {name} " in done.stdout  # the epilog lists every section


def test_every_section_imports_on_cpu_and_is_registered(bench_run) -> None:
    for name in SECTION_MODULES:
        module = importlib.import_module(f"scripts.bench.{name}")
        assert callable(module.run)
        assert bench_run.SECTIONS[name].run is module.run
    assert set(bench_run.SECTIONS) == set(SECTION_MODULES)
    assert [n for n, s in bench_run.SECTIONS.items() if s.needs_model] == ["systemone", "s1batch", "generate", "decodeprof"]


def test_command_line_is_typed_and_checked(bench_run, tmp_path: Path) -> None:
    options = bench_run.parse(["--out", str(tmp_path), "--sections", "env,generate", "--gen-batches", "4,8",
                               "--edit-args", "--strength 0.1 --no-canary"])
    assert options.sections == ("env", "generate")
    assert options.gen_batches == (4, 8)
    assert options.edit_args == ("--strength", "0.1", "--no-canary")
    with pytest.raises(SystemExit) as unknown:
        bench_run.parse(["--out", str(tmp_path), "--sections", "env,profile"])
    assert unknown.value.code == 2
    with pytest.raises(SystemExit) as retired:  # a finished experiment's flag is gone, not ignored
        bench_run.parse(["--out", str(tmp_path), "--s1-compile"])
    assert retired.value.code == 2


def test_results_keep_the_recorded_key_layout(bench_run, tmp_path: Path) -> None:
    from scripts.bench.common import Bench

    bench = Bench(bench_run.parse(["--out", str(tmp_path / "out")]))
    bench.results.systemone = {"model": "m", "input_tokens": 1064,
                               "stock": {"median_ms": 68.7, "p95_ms": 102.2, "min_ms": 60.0, "n": 50}}
    bench.results.canary["fast"] = {"exit_code": 1, "total_s": 96.5}
    bench.results.load_s["m"] = 3.9
    bench.say("a line")
    bench.write()
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(data) == {"systemone", "canary_fast", "load_s"}
    assert data["canary_fast"]["total_s"] == 96.5
    assert "| stock | 68.7 | 102.2 | 50 |" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "log.txt").read_text().strip().endswith("a line")
