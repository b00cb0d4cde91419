"""Entry point: ``python -m scripts.bench --out DIR --sections env,systemone,generate --model random9b``.

Parses the command line into :class:`~scripts.bench.common.Options`, loads the model once for the
sections that need one, runs the sections in the order given and writes ``results.json``,
``results.md`` and ``log.txt`` to ``--out`` after each (a failed section is recorded and the others
still run). Run it from the repository root.
"""

from __future__ import annotations

import argparse
import os
import shlex
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from scripts.bench import canary, decodeprof, edit, env, generate, s1batch, systemone
from scripts.bench.common import Bench, Options
from scripts.bench.models import Loaded, load_model


@dataclass(frozen=True)
class Section:
    """One benchmark section: its runner and whether it needs the ``--model`` loaded."""

    run: Callable[..., None]
    needs_model: bool
    help: str


SECTIONS = {
    "env": Section(env.run, False, "versions, GPU, bf16 matmul and device-copy ceilings"),
    "systemone": Section(systemone.run, True, "SystemOne latency, stock vs fast paths, agreement"),
    "s1batch": Section(s1batch.run, True, "SystemOne req/s on mixed lengths: one at a time vs length-aware batches"),
    "generate": Section(generate.run, True, "greedy generation tokens/s, stock vs fast decoder"),
    "decodeprof": Section(decodeprof.run, True, "batch-1 decode step: replay ms vs floor, kernels by category"),
    "edit": Section(edit.run, False, "blaze edit on the 9B fixture, stages timed"),
    "canary": Section(canary.run, False, "blaze canary on the edit's variant, timed"),
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parser() -> argparse.ArgumentParser:
    """The command line (``--help`` lists the sections)."""
    sections = "\n".join(f"  {name:<10} {section.help}" for name, section in SECTIONS.items())
    p = argparse.ArgumentParser(
        prog="python -m scripts.bench", description=__doc__.split("\n\n")[0],
        epilog=f"sections:\n{sections}\n\nBENCHMARKS.md records what each run measured and its command.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, results.md, log.txt")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/blaze-bench"), help="fixtures and variants")
    p.add_argument("--variant-dir", type=Path, default=None,
                   help="edit/canary: the variant's folder (default WORKDIR/variant); e.g. on /dev/shm when the "
                        "disk cannot hold base and variant (the 27b fixture is 55.6 GB)")
    p.add_argument("--sections", default="env,systemone,generate", help="comma separated, run in this order")
    p.add_argument("--model", default="random9b",
                   help="systemone/generate: 'random9b' (9B shapes in GPU memory), 'edit-base' (the edit "
                        "section's fixture), 'tiny', or a release folder")
    p.add_argument("--device", default="cuda", help="'cpu' with --model tiny: a smoke test of the script itself")
    p.add_argument("--num-layers", type=int, default=None, help="fixture layers for edit/canary (default 32)")
    p.add_argument("--preset", default="9b", help="fixture preset for edit/canary and --model edit-base: 9b, 27b ('tiny' for a CPU smoke test)")
    p.add_argument("--s1-tokens", type=int, default=1029, help="systemone: pad the invoice request to this")
    p.add_argument("--s1-repeats", type=int, default=60, help="systemone: timed requests per path")
    p.add_argument("--s1-warmup", type=int, default=5, help="systemone: untimed requests first")
    p.add_argument("--s1-agree", type=int, default=100, help="systemone: requests checked for answer agreement")
    p.add_argument("--s1-control", action="store_true",
                   help="systemone: compare the stock path with itself under SDPA's math kernel (rounding floor)")
    p.add_argument("--s1b-requests", type=int, default=32, help="s1batch: requests of mixed lengths")
    p.add_argument("--s1b-min", type=int, default=200, help="s1batch: shortest request (tokens)")
    p.add_argument("--s1b-max", type=int, default=4000, help="s1batch: longest request (tokens)")
    p.add_argument("--s1b-batches", type=_ints, default=(8, 32), help="s1batch: batch sizes (max rows)")
    p.add_argument("--s1b-budget", type=int, default=8192, help="s1batch: padded tokens per batch")
    p.add_argument("--s1b-overhead", type=int, default=256,
                   help="s1batch: padding allowed per extra row (BatchingSettings.overhead_tokens)")
    p.add_argument("--s1b-graph-tokens", type=int, default=2048,
                   help="s1batch: largest padded batch replayed from a CUDA graph (BatchingSettings.graph_tokens)")
    p.add_argument("--s1b-repeats", type=int, default=3, help="s1batch: timed passes per path")
    p.add_argument("--s1b-count-batches", action="store_true",
                   help="s1batch: also time the previous count-based batching (release forward per batch)")
    p.add_argument("--prof-steps", type=int, default=200, help="decodeprof: timed graph replays")
    p.add_argument("--gen-tokens", type=int, default=64, help="generate: new tokens per prompt")
    p.add_argument("--gen-batches", type=_ints, default=(16,), help="generate: batch sizes after 1, e.g. 16")
    p.add_argument("--fast-extra-batches", type=_ints, default=(64,), help="generate: fast decoder only")
    p.add_argument("--stock-batch-limit", type=int, default=16, help="generate: largest stock batch")
    p.add_argument("--edit-args", default="", help="extra blaze edit options, one string")
    p.add_argument("--edit-repeat", action="store_true",
                   help="edit section on an existing fixture: statistics cache cleared, JIT caches warm")
    p.add_argument("--relaxed-gate", action="store_true",
                   help="edit with a copy of the verbosity spec whose gate passes anything (random weights)")
    p.add_argument("--grid", default=None, help="with --relaxed-gate: strength grid, e.g. 0.1,0.2")
    p.add_argument("--skip-jit-warm", action="store_true",
                   help="do not compile fla's kernels before the edit (the edit then pays the JIT itself)")
    p.add_argument("--canary-args", default="", help="extra blaze canary options, one string")
    p.add_argument("--canary-stock", action="store_true", help="also time blaze canary with BLAZE_FAST=0")
    return p


def parse(argv: Sequence[str] | None = None) -> Options:
    """Parse and check the command line (an unknown section is an argparse error, exit 2)."""
    p = parser()
    ns = p.parse_args(argv)
    sections = tuple(s for s in ns.sections.split(",") if s)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    values = vars(ns) | {"sections": sections, "edit_args": tuple(shlex.split(ns.edit_args)),
                         "canary_args": tuple(shlex.split(ns.canary_args))}
    return Options(**values)


def _reset_peak() -> None:
    """Start a section's peak GPU memory count (no-op without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _record_peak(bench: Bench, name: str) -> None:
    """Record the section's peak GPU memory (weights of a model loaded earlier included)."""
    import torch

    if torch.cuda.is_available():
        bench.results.peak_gpu_gib[name] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the chosen sections; results are written after each one and at the end."""
    options = parse(argv)
    options.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BLAZE_QUIET", "1")
    bench = Bench(options)
    loaded: Loaded | None = None
    try:
        for name in options.sections:
            section = SECTIONS[name]
            bench.say(f"=== {name}")
            _reset_peak()
            try:
                if section.needs_model:
                    loaded = loaded or load_model(bench)
                    section.run(bench, loaded)
                else:
                    section.run(bench)
            except Exception:  # noqa: BLE001 - one failed section must not lose the others' numbers
                bench.results.errors[name] = traceback.format_exc()
                bench.say(f"section {name} FAILED:\n{traceback.format_exc()}")
            _record_peak(bench, name)
            bench.write()
    finally:
        bench.write()
    print(bench.results.to_markdown())
