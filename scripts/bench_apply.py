"""Benchmark `blaze apply` on a full-size (9B-shaped) fixture against a plain copy of the same files.

Builds (or reuses) a `--preset 9b` random-weight Clef release with all 32 layers, makes a verbosity-shaped
patch (rank-1 deltas on down_proj / o_proj / out_proj of layers 8-24), then, for each round, times
1. a plain copy of every base file (`shutil.copyfile` per file, what `cp` does), and
2. `blaze apply PATCH --base BASE --out OUT` in a child process,
each followed by `sync` (reported separately, so both "returned" and "on disk" times are visible), and
reads the apply child's peak RSS from `os.wait4`. The copy is deleted before the apply runs, the output
after; `--cleanup` removes the base too. Results are printed as JSON and as a Markdown table row.

Page cache: the machine has less RAM than base + output, so the first round reads mostly from disk and
later rounds partly from cache; every round is reported, nothing is averaged away.

    .venv/bin/python scripts/bench_apply.py --work /tmp/blaze-bench --rounds 2 --cleanup
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clef_model.checkpoint import CheckpointReader  # noqa: E402
from clef_model.fixtures import build_fixture  # noqa: E402
from clef_model.release import resolve_release  # noqa: E402
from surgery.patch import Patch, base_identity  # noqa: E402

WRITERS = ("mlp.down_proj.weight", "self_attn.o_proj.weight", "linear_attn.out_proj.weight")


def make_patch(base, layers: range, rel_change: float = 0.01, seed: int = 0) -> Patch:
    """Rank-1 deltas on the residual writers of `layers`, ‖ΔW‖ = rel_change·‖W‖ (reads only those tensors)."""
    reader = CheckpointReader(base.path)
    gen = torch.Generator().manual_seed(seed)
    names = sorted(n[: -len(".weight")] for n in reader.names()
                   if n.startswith("model.language_model.layers.") and n.endswith(WRITERS)
                   and int(n.split(".")[3]) in layers)
    factors = {}
    for name in names:
        weight_norm = float(reader.tensor(f"{name}.weight").float().norm())
        u = torch.randn(reader.shape(f"{name}.weight")[0], 1, generator=gen)
        v = torch.randn(reader.shape(f"{name}.weight")[1], 1, generator=gen)
        u *= rel_change * weight_norm / (float(u.norm()) * float(v.norm()))
        factors[name] = (u, v)
    return Patch(factors, base_identity(base, names),
                 {"method": "bench-rank1", "k": 1, "layers": f"{layers.start}-{layers.stop - 1}"})


def timed_sync() -> float:
    started = time.perf_counter()
    os.sync()
    return time.perf_counter() - started


def plain_copy(src: Path, dst: Path) -> float:
    started = time.perf_counter()
    dst.mkdir(parents=True)
    for path in sorted(src.iterdir()):
        if path.is_file():
            shutil.copyfile(path, dst / path.name)
    return time.perf_counter() - started


def run_apply(patch: Path, base: Path, out: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of `blaze apply` in a child process."""
    env = dict(os.environ, BLAZE_QUIET="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", "from variants.cli import main; main()", "apply", str(patch),
               "--base", str(base), "--out", str(out)]
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"blaze apply failed with exit code {child.returncode}")
    return seconds, usage.ru_maxrss * 1024


def check_output(base: Path, out: Path, patch: Patch) -> dict:
    """Cheap sanity checks on the variant: same tensor set, a few untouched tensors identical, edits present."""
    a, b = CheckpointReader(base), CheckpointReader(out)
    assert set(a.names()) == set(b.names())
    edited = {f"{n}.weight" for n in patch.names()}
    untouched = [n for n in a.names() if n not in edited and a.nbytes(n) < 200_000_000][:: max(1, len(a.names()) // 8)]
    assert all(a.raw_bytes(n) == b.raw_bytes(n) for n in untouched)
    first = sorted(edited)[0]
    assert a.raw_bytes(first) != b.raw_bytes(first)
    manifest = json.loads((out / "blaze_manifest.json").read_text())
    return {"edited": len(manifest["matrices"]), "checked_untouched": len(untouched)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="Scratch folder (needs ~3× 19.3 GB free at peak… "
                        "base + one copy or output at a time: ~40 GB).")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cleanup", action="store_true", help="Delete the base fixture at the end.")
    parser.add_argument("--num-layers", type=int, default=None, help="Smoke runs only: keep the first N layers.")
    parser.add_argument("--layers", default="8-24", help="Edited layers, FIRST-LAST (default 8-24).")
    args = parser.parse_args()

    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    base_dir = work / "base-9b"
    started = time.perf_counter()
    if not (base_dir / "model.safetensors.index.json").is_file():
        build_fixture(base_dir, "9b", num_layers=args.num_layers, seed=0, force=True, progress=True)
    build_seconds = time.perf_counter() - started
    base = resolve_release(base_dir)
    patch_file = work / "delta.safetensors"
    first, last = (int(x) for x in args.layers.split("-"))
    patch = make_patch(base, range(first, last + 1))
    patch.save(patch_file)
    total = sum(p.stat().st_size for p in base_dir.iterdir() if p.is_file())
    print(f"base {total / 1e9:.2f} GB ({build_seconds:.0f} s to build/reuse); patch {len(patch.names())} matrices",
          flush=True)

    rounds = []
    try:
        for number in range(1, args.rounds + 1):
            copy_dir, out_dir = work / "copy", work / "variant"
            shutil.rmtree(copy_dir, ignore_errors=True)
            shutil.rmtree(out_dir, ignore_errors=True)
            timed_sync()
            copy_s = plain_copy(base_dir, copy_dir)
            copy_sync = timed_sync()
            shutil.rmtree(copy_dir)
            timed_sync()
            apply_s, rss = run_apply(patch_file, base_dir, out_dir)
            apply_sync = timed_sync()
            checks = check_output(base_dir, out_dir, patch)
            shutil.rmtree(out_dir)
            row = {
                "round": number,
                "copy_s": round(copy_s, 1), "copy_plus_sync_s": round(copy_s + copy_sync, 1),
                "apply_s": round(apply_s, 1), "apply_plus_sync_s": round(apply_s + apply_sync, 1),
                "ratio": round(apply_s / copy_s, 2),
                "ratio_with_sync": round((apply_s + apply_sync) / (copy_s + copy_sync), 2),
                "apply_peak_rss_mib": round(rss / 2**20), **checks,
            }
            rounds.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work / "copy", ignore_errors=True)
        shutil.rmtree(work / "variant", ignore_errors=True)
        if args.cleanup:
            shutil.rmtree(base_dir, ignore_errors=True)
            patch_file.unlink(missing_ok=True)

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "base_bytes": total, "rounds": rounds}
    print(json.dumps(info, indent=2))
    print("| round | copy s (+sync) | apply s (+sync) | ratio (+sync) | apply peak RSS |")
    print("|---|---|---|---|---|")
    for r in rounds:
        print(f"| {r['round']} | {r['copy_s']} ({r['copy_plus_sync_s']}) | {r['apply_s']} ({r['apply_plus_sync_s']}) "
              f"| {r['ratio']} ({r['ratio_with_sync']}) | {r['apply_peak_rss_mib']} MiB |")


if __name__ == "__main__":
    main()
