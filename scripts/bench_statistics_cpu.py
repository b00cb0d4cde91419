"""The statistics pass on the CPU with the padded width rounded to 64 tokens (the CUDA bucket) against exact
widths (what the CPU now uses), from one process, interleaved.

For the README's main job on 2 CPU cores (issue 15 item 6). Loads an embedded model (`--base`, default smollm2)
in float32, builds the verbosity spec's statistics inputs exactly as `blaze edit` does (the first `--pairs`
training pairs read as shared_response, the default preserve set with the training questions' tokens), and
runs `surgery.statistics.collect` over the default targets (writers of layers 0.3-0.8) `--repeats` times per
setting, alternating. Prints the padded token counts, the seconds of each run and the ratio of the medians, and
the largest relative difference between the two settings' moments (padding must not change what is read).

    .venv/bin/python scripts/bench_statistics_cpu.py --pairs 134 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics as stats
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="smollm2")
    parser.add_argument("--pairs", type=int, default=134, help="training pairs to read (default: all 134)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("BLAZE_QUIET", "1")
    import torch

    import surgery.statistics as st
    from clef_model.runtime import Runtime
    from surgery.edit import collect_statistics
    from surgery.plan import plan as edit_plan
    from variants.build import BuildOptions, contrast_pairs, edit_settings, preserve_set
    from variants.spec import load_behavior

    runtime = Runtime.load(args.base, device="cpu", dtype=torch.float32)
    spec = load_behavior("verbosity")
    pairs = contrast_pairs(spec)[: args.pairs]
    settings = edit_settings(spec, BuildOptions(behavior="verbosity", out=None), pairs)  # type: ignore[arg-type]
    plan = edit_plan(runtime, settings.layers, settings.kinds)
    preserve = preserve_set(spec, runtime, questions=settings.questions == "preserve")
    print(f"# {args.base}, {len(pairs)} pairs ({settings.positions}), {len(plan.targets)} targets, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    sets = [sorted(len(s.ids) for s in seqs) for seqs in  # each set is sorted and batched on its own, as collect does
            (st.contrast_sequences(runtime, pairs, 1024, settings.positions), st.preserve_sequences(runtime, preserve))]
    read = sum(sum(lengths) for lengths in sets)
    for bucket in (64, 1):
        padded = sum(-(-max(lengths[i:i + 8]) // bucket) * bucket * len(lengths[i:i + 8])
                     for lengths in sets for i in range(0, len(lengths), 8))
        print(f"bucket {bucket:>2}: {padded} padded tokens for {read} read ({padded / read:.2f}×)")
    original = st.width_bucket
    times: dict[int, list[float]] = {64: [], 1: []}
    results = {}
    try:
        for _ in range(args.repeats):
            for bucket in (64, 1):
                st.width_bucket = lambda _device, b=bucket: b  # type: ignore[assignment]
                start = time.perf_counter()
                results[bucket] = collect_statistics(runtime, pairs, preserve, settings.layers, settings.kinds,
                                                     rank=settings.rank, cache=None, progress=False,
                                                     positions=settings.positions)
                times[bucket].append(time.perf_counter() - start)
                print(f"bucket {bucket:>2}: {times[bucket][-1]:.1f} s")
    finally:
        st.width_bucket = original
    worst = 0.0
    for name, a in results[64].keys.items():
        b = results[1].keys[name]
        for x, y in ((a.behaviour_moment, b.behaviour_moment), (a.preserve_moment, b.preserve_moment)):
            if x is not None and y is not None:
                worst = max(worst, float((x - y).abs().max() / x.abs().max().clamp(min=1e-30)))
    m64, m1 = stats.median(times[64]), stats.median(times[1])
    print(f"median: bucket 64 {m64:.1f} s, exact {m1:.1f} s: exact/64 = {m1 / m64:.2f}; "
          f"largest relative moment difference {worst:.1e}")


if __name__ == "__main__":
    main()
