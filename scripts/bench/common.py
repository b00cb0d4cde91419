"""What every benchmark section shares: the options, the run's state (device, log, results) and timing.

The run's state lives in one :class:`Bench` object handed to each section, instead of module globals, so a
section can be imported and run on its own (tests import every section on a CPU machine).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from scripts.bench.results import Results

T = TypeVar("T")


@dataclass(frozen=True)
class Options:
    """The command line, typed (see ``scripts/bench/run.py`` for each option's help)."""

    out: Path
    workdir: Path
    variant_dir: Path | None
    sections: tuple[str, ...]
    model: str
    device: str
    num_layers: int | None
    preset: str
    s1_tokens: int
    s1_repeats: int
    s1_warmup: int
    s1_agree: int
    s1_control: bool
    s1b_requests: int
    s1b_min: int
    s1b_max: int
    s1b_batches: tuple[int, ...]
    s1b_budget: int
    s1b_overhead: int
    s1b_graph_tokens: int
    s1b_repeats: int
    s1b_count_batches: bool
    prof_steps: int
    gen_tokens: int
    gen_batches: tuple[int, ...]
    fast_extra_batches: tuple[int, ...]
    stock_batch_limit: int
    edit_args: tuple[str, ...]
    edit_repeat: bool
    relaxed_gate: bool
    grid: str | None
    skip_jit_warm: bool
    canary_args: tuple[str, ...]
    canary_stock: bool


@dataclass
class Bench:
    """One benchmark run: its options, its log lines and its results; written to ``options.out``."""

    options: Options
    results: Results = field(default_factory=Results)
    log: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        """``cuda`` for real figures; ``cpu`` runs a smoke test of the script itself on the tiny fixture."""
        return self.options.device

    def say(self, message: str) -> None:
        """Print a time-stamped line and keep it for ``log.txt``."""
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        self.log.append(line)

    def failed(self, what: str) -> str:
        """Log the exception being handled under ``what`` and return its one-line summary for the results."""
        error = sys.exc_info()[1]
        self.say(f"{what} FAILED: {traceback.format_exc()}")
        return f"{type(error).__name__}: {error}"

    def write(self) -> None:
        """Write ``results.json``, ``results.md`` and ``log.txt`` (again after every section)."""
        out = self.options.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(self.results.to_json())
        (out / "results.md").write_text(self.results.to_markdown())
        (out / "log.txt").write_text("\n".join(self.log) + "\n")


def sync() -> None:
    """Wait for the GPU (no-op without CUDA), so that wall-clock times include the queued work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(result, seconds) with the device synchronised on both sides."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linearly interpolated."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(values: list[float]) -> dict[str, float]:
    """Median, p95 and min in milliseconds of timings in seconds, and how many there were."""
    ms = [v * 1000 for v in values]
    return {"median_ms": round(statistics.median(ms), 2), "p95_ms": round(pct(ms, 0.95), 2),
            "min_ms": round(min(ms), 2), "n": len(ms)}


@contextlib.contextmanager
def fast_setting(value: str | None) -> Iterator[None]:
    """Set BLAZE_FAST (None: unset, i.e. the default) for the block: "0" = stock reference paths."""
    before = os.environ.get("BLAZE_FAST")
    if value is None:
        os.environ.pop("BLAZE_FAST", None)
    else:
        os.environ["BLAZE_FAST"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("BLAZE_FAST", None)
        else:
            os.environ["BLAZE_FAST"] = before


def free_gpu() -> None:
    """Drop unreferenced tensors and return cached GPU memory between measurements."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_cli(bench: Bench, argv: list[str]) -> tuple[int, float]:
    """Run ``blaze ARGV`` in-process; (exit code, seconds)."""
    from variants.cli import main

    start = time.perf_counter()
    code = 0
    try:
        main.main(args=argv, prog_name="blaze", standalone_mode=False)
    except SystemExit as error:
        code = int(error.code or 0)
    except Exception:  # noqa: BLE001 - a failed command is a figure (exit 1), not the end of the run
        bench.say(traceback.format_exc())
        code = 1
    sync()
    return code, time.perf_counter() - start


@contextlib.contextmanager
def timed_runtime_load(sink: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in ``Runtime.load`` to ``sink["load"]`` while the block runs."""
    try:
        from clef_model.runtime import Runtime
    except ImportError:
        yield
        return
    original = Runtime.load.__func__  # type: ignore[attr-defined]

    def load(cls: Any, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(cls, *a, **k)
        finally:
            sync()
            sink["load"] = sink.get("load", 0.0) + time.perf_counter() - start

    Runtime.load = classmethod(load)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Runtime.load = classmethod(original)  # type: ignore[method-assign,assignment]
