"""Section ``edit``: the whole ``blaze edit`` (default verbosity recipe) on the 9B fixture, stages timed.

Builds ``blaze fixture --preset 9b`` under ``--workdir`` (once), then runs ``blaze edit`` in-process and
times its stages: load, statistics (tokens/s, and each forward's shape and seconds, which shows what a new
shape costs in kernel compiles), solve, write, total.

Random weights have no behaviour, so the real gate rejects every strength; ``--relaxed-gate`` edits with a
copy of the spec whose gate passes anything, so the default recipe's whole strength sweep is timed.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from clef_model.env import cache_root
from clef_model.files import INDEX_FILE
from scripts.bench.common import (
    Bench,
    free_gpu,
    run_cli,
    sync,
    timed,
    timed_runtime_load,
)
from scripts.bench.models import base_folder, variant_folder

RELAXED_GATE = {"effect": "none", "min_effect": 0.0, "max_first_token_kl": 1e9, "max_mean_token_kl": 1e9,
                "max_loop_rate": 1.0, "max_limit_rate": 1.0, "max_empty_rate": 1.0, "max_decision_drift": 1e9,
                "max_argmax_flips": 1000000, "min_quality_ratio": 0.0}

STAGES = {"surgery.edit:collect_statistics": "statistics", "surgery.edit:solve": "solve",
          "surgery.write:write_variant": "write", "canaries.run:run_canary": "canary_in_edit"}


@contextlib.contextmanager
def stage_timers(names: dict[str, str], sink: dict[str, float]) -> Iterator[None]:
    """Wrap functions (``"module:attr" -> label``) wherever they are bound in loaded modules; sum seconds."""
    patched: list[tuple[Any, str, Any]] = []
    for target, label in names.items():
        mod_name, attr = target.split(":")
        try:
            original = getattr(importlib.import_module(mod_name), attr)
        except Exception:  # noqa: BLE001 - a stage that no longer exists is simply not timed
            continue

        def wrapper(*a: Any, __orig: Any = original, __label: str = label, **k: Any) -> Any:
            sync()
            start = time.perf_counter()
            try:
                return __orig(*a, **k)
            finally:
                sync()
                sink[__label] = sink.get(__label, 0.0) + time.perf_counter() - start

        for module in list(sys.modules.values()):
            for key, value in list(getattr(module, "__dict__", {}).items()):
                if value is original:
                    setattr(module, key, wrapper)
                    patched.append((module, key, original))
    try:
        yield
    finally:
        for module, key, original in patched:
            setattr(module, key, original)


@contextlib.contextmanager
def count_tokens(sink: dict[str, float], forwards: list[tuple[tuple[int, ...], float]]) -> Iterator[None]:
    """Count the tokens the statistics pass runs (``sink["statistics_tokens"]``) and time each forward."""
    import surgery.statistics as st

    original = getattr(st, "_forward", None)
    if original is None:
        yield
        return

    def counting(model: Any, ids: torch.Tensor, mask: torch.Tensor, *a: Any, **k: Any) -> Any:
        sink["statistics_tokens"] = sink.get("statistics_tokens", 0) + int(mask.sum())
        sync()
        start = time.perf_counter()
        try:
            return original(model, ids, mask, *a, **k)
        finally:
            sync()  # per-forward shape and seconds: shows compile/autotune cost per new shape
            forwards.append((tuple(ids.shape), round(time.perf_counter() - start, 3)))

    st._forward = counting
    try:
        yield
    finally:
        st._forward = original


def warm_fla() -> None:
    """Compile flash-linear-attention's gated-delta-rule kernels for the 9B head shapes (bf16)."""
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return
    for t in (300, 1):
        q = torch.randn(2, t, 16, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn_like(q)
        v = torch.randn(2, t, 32, 128, device="cuda", dtype=torch.bfloat16)
        g = -torch.rand(2, t, 32, device="cuda")
        beta = torch.rand(2, t, 32, device="cuda", dtype=torch.bfloat16)
        fn = chunk_gated_delta_rule if t > 1 else fused_recurrent_gated_delta_rule
        with torch.inference_mode():
            fn(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)


def relaxed_spec(workdir: Path, behavior: str = "verbosity", grid: str | None = None) -> Path:
    """A copy of a shipped spec with RELAXED_GATE, written to WORKDIR/relaxed/BEHAVIOR.json."""
    from variants.spec import load_behavior

    data = json.loads(Path(load_behavior(behavior).source).read_text())
    data["gate"] = {**data.get("gate", {}), **RELAXED_GATE}
    if grid:
        data["defaults"] = {**data.get("defaults", {}), "strength_grid": [float(x) for x in grid.split(",")]}
    target = workdir / "relaxed" / f"{behavior}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1))
    return target


def prehash(folder: Path) -> None:
    """SHA-256 of every file of ``folder`` through blaze's hash cache (8 threads; hashlib releases the GIL)."""
    from clef_model.filehash import file_sha256

    time.sleep(2.1)  # the hash cache trusts only files whose mtime is > 2 s older than the hash
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(file_sha256, files))


def run(bench: Bench) -> None:
    """Build the fixture if needed, then time one ``blaze edit`` end to end and by stage."""
    options = bench.options
    out: dict[str, Any] = {"num_layers": options.num_layers or "all", "preset": options.preset}
    base = base_folder(options)
    _build_base(bench, base, out)
    if bench.device == "cuda" and not options.skip_jit_warm:  # fla's Triton kernels compile on first use
        out["triton_jit_warm_s"] = round(timed(warm_fla)[1], 1)
        bench.say(f"fla JIT warm-up {out['triton_jit_warm_s']}s")
    variant = variant_folder(options)
    behavior = str(relaxed_spec(options.workdir, grid=options.grid)) if options.relaxed_gate else "verbosity"
    out["gate"] = "relaxed (every grid point passes; timing only)" if options.relaxed_gate else "the spec's"
    argv = ["edit", "--behavior", behavior, "--base", str(base), "--out", str(variant), "--force",
            *options.edit_args]
    stages: dict[str, float] = {}
    forwards: list[tuple[tuple[int, ...], float]] = []
    try:
        with stage_timers(STAGES, stages), count_tokens(stages, forwards), timed_runtime_load(stages):
            code, total = run_cli(bench, argv)
    finally:  # also when interrupted (timeout -s INT): keep the forwards seen so far
        out["statistics_forwards"] = [[list(shape), sec] for shape, sec in forwards]
        bench.results.edit = out
    out.update(command="blaze " + " ".join(argv), exit_code=code, total_s=round(total, 1),
               stages_s={k: round(v, 2) for k, v in stages.items() if k != "statistics_tokens"})
    if stages.get("statistics_tokens") and stages.get("statistics"):
        out["statistics_tokens"] = stages["statistics_tokens"]
        out["statistics_tokens_per_s"] = round(stages["statistics_tokens"] / stages["statistics"], 1)
    bench.say(f"edit: {out}")
    free_gpu()


def _build_base(bench: Bench, base: Path, out: dict[str, Any]) -> None:
    """The ``--preset`` fixture at ``base`` (built once), hashed once unless ``--edit-repeat``."""
    from clef_model.fixtures import build_fixture

    options = bench.options
    if not (base / INDEX_FILE).exists():
        _, dt = timed(lambda: build_fixture(base, options.preset, num_layers=options.num_layers, force=True,
                                            progress=False))
        out["fixture_build_s"] = round(dt, 1)
        bench.say(f"fixture {options.preset} ({out['num_layers']} layers) built in {dt:.0f}s")
    out["fixture_gb"] = round(sum(p.stat().st_size for p in base.glob("*.safetensors")) / 1e9, 2)
    if not options.edit_repeat:
        # A base downloaded from the Hub has known SHA-256s (blob names); a freshly built fixture does not.
        # Hash it once, as blaze would on its first use of a local folder, and time that apart from the edit.
        out["base_hash_s"] = round(timed(lambda: prehash(base))[1], 1)
        bench.say(f"base hashed once in {out['base_hash_s']}s (recorded in the hash cache)")
    else:
        # the same edit again in the same process: JIT caches warm, statistics recomputed
        shutil.rmtree(cache_root() / "statistics",
                      ignore_errors=True)
