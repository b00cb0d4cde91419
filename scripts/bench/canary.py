"""Section ``canary``: the whole ``blaze canary VARIANT --against BASE`` with the default suites, timed.

Runs on the variant the ``edit`` section wrote under ``--workdir``; with the fast paths at their default,
and with ``--canary-stock`` also with ``BLAZE_FAST=0``.
"""

from __future__ import annotations

from scripts.bench.common import (
    Bench,
    fast_setting,
    free_gpu,
    run_cli,
    timed_runtime_load,
)
from scripts.bench.models import base_folder, variant_folder


def run(bench: Bench) -> None:
    """Time ``blaze canary`` (fast paths on; then off with ``--canary-stock``), load time apart."""
    workdir = bench.options.workdir
    argv = ["canary", str(variant_folder(bench.options)), "--against", str(base_folder(bench.options)),
            *bench.options.canary_args]
    runs = [("fast", None)] + ([("stock", "0")] if bench.options.canary_stock else [])
    for label, setting in runs:
        stages: dict[str, float] = {}
        with fast_setting(setting), timed_runtime_load(stages):
            code, total = run_cli(bench, [*argv, "--json", str(workdir / f"canary_{label}.json")])
        record = {"command": "blaze " + " ".join(argv), "BLAZE_FAST": setting or "default", "exit_code": code,
                  "total_s": round(total, 1), "stages_s": {k: round(v, 2) for k, v in stages.items()}}
        bench.results.canary[label] = record
        bench.say(f"canary {label}: {record}")
        free_gpu()
