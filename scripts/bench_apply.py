"""Benchmark `blaze apply` on a full-size (9B-shaped) fixture against a plain copy of the same files.

Builds (or reuses) a `--preset 9b` random-weight Clef release with all 32 layers and makes a
verbosity-shaped patch (rank-1 deltas on down_proj / o_proj / out_proj of layers 8-24). The base is then
laid out the way users have it, in one or both `--layout`s:

- `hub` (the primary figure): a Hugging Face cache repository as `huggingface_hub` writes it,
  `models--blaze-bench--clef-9b/blobs/<hash>` plus `snapshots/<revision>/<file>` symlinks and
  `refs/main`. LFS files (`*.safetensors` and anything over 10 MB) are named by their SHA-256, small files
  by their git blob SHA-1, as on the Hub. `blaze apply` is given the snapshot folder.
- `folder`: a plain folder (hard links to the same files), whose inputs blaze must hash (first apply).

Each round, for each layout and page-cache state, times
1. a plain copy of every base file (`shutil.copyfile` per file, following the snapshot's symlinks: what
   `cp -L` does), and
2. `blaze apply PATCH --base BASE --out OUT` in a child process, with an empty hash cache (a fresh
   `BLAZE_CACHE`), so nothing from an earlier run helps; peak RSS from `os.wait4`.
Each is followed by `sync` (reported separately: "returned" and "on disk"). The page-cache state before
each timed operation is set explicitly: `cold` evicts the base's pages (`posix_fadvise(DONTNEED)` after a
`sync`), `warm` reads the base once first (on a machine whose RAM cannot hold base + output, part of it
is evicted again while the output is written). The copy runs first in odd rounds and second in even
rounds. Each copy or output is deleted before the next step; `--cleanup` removes the base too.
Results are printed as JSON lines and as a Markdown table, with the load average before each row and the
CPU seconds (user + system) of the copy and of the apply process (the kernel's writeback threads count in
neither).

    .venv/bin/python scripts/bench_apply.py --work /tmp/blaze-bench --rounds 2 --cleanup
    .venv/bin/python scripts/bench_apply.py --work /tmp/blaze-bench --num-layers 4 --layers 1-3   # smoke
    .venv/bin/python scripts/bench_apply.py --work /tmp/b27 --preset 27b --num-layers 8 --layers 2-6 --rounds 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clef_model.checkpoint import CheckpointReader, sha256_file  # noqa: E402
from clef_model.files import INDEX_FILE  # noqa: E402
from clef_model.manifest import read_manifest  # noqa: E402
from clef_model.release import resolve_release  # noqa: E402
from surgery.delta import PatchArrays, base_identity  # noqa: E402

WRITERS = ("mlp.down_proj.weight", "self_attn.o_proj.weight", "linear_attn.out_proj.weight")
HUB_REPO = "models--blaze-bench--clef-9b"
LFS_BYTES = 10 * 10**6  # the Hub stores files above this size (and every *.safetensors) through LFS


def make_patch(base, layers: range, rel_change: float = 0.01, seed: int = 0) -> PatchArrays:
    """Rank-1 deltas on the residual writers of `layers`, ‖ΔW‖ = rel_change·‖W‖ (reads only those tensors)."""
    reader = CheckpointReader(base.path)
    rng = np.random.default_rng(seed)
    names = sorted(n[: -len(".weight")] for n in reader.names()
                   if n.startswith("model.language_model.layers.") and n.endswith(WRITERS)
                   and int(n.split(".")[3]) in layers)
    factors = {}
    for name in names:
        weight = reader.array(f"{name}.weight").astype(np.float32).reshape(-1)
        weight_norm = float(np.sqrt(np.dot(weight, weight)))
        del weight
        u = rng.standard_normal((reader.shape(f"{name}.weight")[0], 1)).astype(np.float32)
        v = rng.standard_normal((reader.shape(f"{name}.weight")[1], 1)).astype(np.float32)
        u *= rel_change * weight_norm / (float(np.linalg.norm(u)) * float(np.linalg.norm(v)))
        factors[name] = (u, v)
    return PatchArrays(factors, base_identity(base, names),
                       {"method": "bench-rank1", "k": 1, "layers": f"{layers.start}-{layers.stop - 1}"})


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file (what the Hub names a small, non-LFS file's blob)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def make_hub_layout(folder: Path, hub: Path) -> Path:
    """Lay `folder`'s files out as a Hugging Face cache repository under `hub`; returns the snapshot folder.

    The blobs are hard links to `folder`'s files, so both layouts share one copy of the bytes on disk.
    """
    repo = hub / HUB_REPO
    revision = hashlib.sha1(b"blaze-bench").hexdigest()
    snapshot = repo / "snapshots" / revision
    if snapshot.is_dir() and (snapshot / INDEX_FILE).exists():
        return snapshot
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder)
        lfs = path.suffix == ".safetensors" or path.stat().st_size > LFS_BYTES
        blob = repo / "blobs" / (sha256_file(path) if lfs else git_blob_sha1(path))
        if not blob.exists():
            os.link(path, blob)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def base_files(base: Path) -> list[Path]:
    """Every file of a base folder (symlinks included), sorted."""
    return sorted(p for p in base.rglob("*") if p.is_file())


def timed_sync() -> float:
    started = time.perf_counter()
    os.sync()
    return time.perf_counter() - started


def set_page_cache(files: list[Path], state: str) -> None:
    """`cold`: drop the files' clean pages from the page cache; `warm`: read them once."""
    os.sync()
    for path in files:
        with open(path, "rb") as handle:
            if state == "cold":
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while handle.read(1 << 24):
                    pass


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def plain_copy(src: Path, dst: Path) -> tuple[float, float]:
    """Copy every file of `src` (following symlinks) into `dst`; (wall seconds, CPU seconds user + system)."""
    started, cpu = time.perf_counter(), _cpu_seconds()
    dst.mkdir(parents=True)
    for path in base_files(src):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return time.perf_counter() - started, _cpu_seconds() - cpu


# Runs one command and prints {"seconds", "cpu_seconds", "maxrss_kib", "exit"}: the command is forked from this small
# launcher, not from the benchmark process. Linux keeps a process's peak RSS across exec, so a child forked
# straight from a big parent reports the parent's size (a parent that had imported torch made every
# earlier apply figure at least ≈ 700 MiB, whatever apply itself used).
_LAUNCHER = """
import json, os, sys, time
started = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(json.dumps({"seconds": time.perf_counter() - started, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                  "maxrss_kib": usage.ru_maxrss,
                  "exit": os.waitstatus_to_exitcode(status)}))
"""


def run_apply(patch: Path, base: Path, out: Path, cache_dir: Path) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system, all threads) and peak RSS (bytes, `os.wait4`) of
    `blaze apply` in a child process, with an empty hash cache."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    env = dict(os.environ, BLAZE_QUIET="1", PYTHONPATH=str(ROOT), BLAZE_CACHE=str(cache_dir))
    env.pop("BLAZE_HASH_CACHE", None)
    command = [sys.executable, "-c", "from variants.cli import main; main()", "apply", str(patch),
               "--base", str(base), "--out", str(out)]
    launched = subprocess.run([sys.executable, "-c", _LAUNCHER, *command], env=env, stdout=subprocess.PIPE,
                              text=True, check=True)
    result = json.loads(launched.stdout.strip().splitlines()[-1])
    if result["exit"] != 0:
        raise SystemExit(f"blaze apply failed with exit code {result['exit']}")
    return result["seconds"], result["cpu_seconds"], result["maxrss_kib"] * 1024


def build_base(folder: Path, num_layers: int | None, preset: str = "9b") -> None:
    """Build the fixture in a child process (it needs torch; this process stays small)."""
    code = ("import sys; from pathlib import Path; from clef_model.fixtures import build_fixture; "
            "build_fixture(Path(sys.argv[1]), sys.argv[3], num_layers=None if sys.argv[2] == '-' else "
            "int(sys.argv[2]), seed=0, force=True, progress=True)")
    subprocess.run([sys.executable, "-c", code, str(folder), "-" if num_layers is None else str(num_layers), preset],
                   env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)


def check_output(base: Path, out: Path, patch: PatchArrays) -> dict:
    """Cheap sanity checks on the variant: same tensor set, a few untouched tensors identical, edits present."""
    a, b = CheckpointReader(base), CheckpointReader(out)
    assert set(a.names()) == set(b.names())
    edited = {f"{n}.weight" for n in patch.names()}
    untouched = [n for n in a.names() if n not in edited and a.nbytes(n) < 200_000_000][:: max(1, len(a.names()) // 8)]
    assert all(a.raw_bytes(n) == b.raw_bytes(n) for n in untouched)
    first = sorted(edited)[0]
    assert a.raw_bytes(first) != b.raw_bytes(first)
    return {"edited": len(read_manifest(out).matrices), "checked_untouched": len(untouched)}


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True,
                        help="Scratch folder (base + one copy or output at a time: ~40 GB for 32 layers).")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layout", default="hub,folder",
                        help="Comma list of base layouts: hub (Hugging Face cache snapshot), folder (plain folder).")
    parser.add_argument("--cache", default="cold,warm",
                        help="Comma list of page-cache states before each timed operation: cold, warm.")
    parser.add_argument("--cleanup", action="store_true", help="Delete the base fixture at the end.")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="Keep the first N layers (smoke runs; or a 27B-shaped base that fits the disk twice).")
    parser.add_argument("--preset", default="9b", choices=["9b", "27b"],
                        help="Fixture shapes: 9b (Clef-Flash) or 27b (Clef: hidden 5120, MLP 17408, vocab 248,320).")
    parser.add_argument("--layers", default="8-24", help="Edited layers, FIRST-LAST (default 8-24).")
    args = parser.parse_args()
    layouts = [x.strip() for x in args.layout.split(",") if x.strip()]
    caches = [x.strip() for x in args.cache.split(",") if x.strip()]
    if not layouts or set(layouts) - {"hub", "folder"} or not caches or set(caches) - {"cold", "warm"}:
        parser.error("--layout takes hub and/or folder; --cache takes cold and/or warm")

    os.environ["BLAZE_HASH_CACHE"] = "0"  # this process: never touch the user's hash cache (children get their own)
    work = args.work.absolute()
    work.mkdir(parents=True, exist_ok=True)
    folder = work / f"base-{args.preset}"
    started = time.perf_counter()
    if not (folder / INDEX_FILE).is_file():
        shutil.rmtree(work / "hub", ignore_errors=True)
        build_base(folder, args.num_layers, args.preset)
    build_seconds = time.perf_counter() - started
    started = time.perf_counter()
    snapshot = make_hub_layout(folder, work / "hub")
    hub_seconds = time.perf_counter() - started
    bases = {"hub": snapshot, "folder": folder}
    patch_file = work / "delta.safetensors"
    first, last = (int(x) for x in args.layers.split("-"))
    # made on the Hub layout, as `blaze edit` on a downloaded base would: the identity records shard hashes
    patch = make_patch(resolve_release(snapshot), range(first, last + 1))
    patch.save(patch_file)
    total = sum(p.stat().st_size for p in base_files(folder))
    print(f"base {total / 1e9:.2f} GB ({build_seconds:.0f} s to build/reuse, {hub_seconds:.0f} s for the hub "
          f"layout); patch {len(patch.names())} matrices", flush=True)

    rows = []
    copy_dir, out_dir, cache_dir = work / "copy", work / "variant", work / "blaze-cache"
    try:
        for number in range(1, args.rounds + 1):
            for layout in layouts:
                base = bases[layout]
                files = base_files(base)
                for cache in caches:
                    load = load_average()
                    shutil.rmtree(copy_dir, ignore_errors=True)
                    shutil.rmtree(out_dir, ignore_errors=True)
                    timings: dict[str, float] = {}
                    order = ("copy", "apply") if number % 2 else ("apply", "copy")
                    for step in order:
                        set_page_cache(files, cache)
                        if step == "copy":
                            timings["copy_s"], timings["copy_cpu_s"] = plain_copy(base, copy_dir)
                            timings["copy_sync_s"] = timed_sync()
                            shutil.rmtree(copy_dir)
                        else:
                            timings["apply_s"], timings["apply_cpu_s"], rss = run_apply(patch_file, base, out_dir,
                                                                                        cache_dir)
                            timings["apply_sync_s"] = timed_sync()
                            checks = check_output(base, out_dir, patch)
                            shutil.rmtree(out_dir)
                    copy_s, apply_s = timings["copy_s"], timings["apply_s"]
                    copy_total = copy_s + timings["copy_sync_s"]
                    apply_total = apply_s + timings["apply_sync_s"]
                    row = {
                        "round": number, "layout": layout, "cache": cache, "first": order[0], "load_before": load,
                        "copy_s": round(copy_s, 1), "copy_plus_sync_s": round(copy_total, 1),
                        "apply_s": round(apply_s, 1), "apply_plus_sync_s": round(apply_total, 1),
                        "ratio": round(apply_s / copy_s, 2), "ratio_with_sync": round(apply_total / copy_total, 2),
                        "copy_cpu_s": round(timings["copy_cpu_s"], 1), "apply_cpu_s": round(timings["apply_cpu_s"], 1),
                        "apply_peak_rss_mib": round(rss / 2**20), **checks,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(copy_dir, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
        if args.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(work / "hub", ignore_errors=True)
            patch_file.unlink(missing_ok=True)

    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "base_bytes": total,
            "load_after": load_average(), "rounds": rows}
    print(json.dumps(info, indent=2))
    print("| round | layout | page cache | first | load before | copy s (+sync) | apply s (+sync) | ratio (+sync) "
          "| CPU s copy / apply | apply peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['round']} | {r['layout']} | {r['cache']} | {r['first']} | {r['load_before']} "
              f"| {r['copy_s']} ({r['copy_plus_sync_s']}) | {r['apply_s']} ({r['apply_plus_sync_s']}) "
              f"| {r['ratio']} ({r['ratio_with_sync']}) | {r['copy_cpu_s']} / {r['apply_cpu_s']} "
              f"| {r['apply_peak_rss_mib']} MiB |")


if __name__ == "__main__":
    main()
