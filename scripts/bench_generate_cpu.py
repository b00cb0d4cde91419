"""Free-form generation on the CPU: transformers' `generate` against blaze's decode that drops stopped answers.

For the README's main job on 2 CPU cores (issue 15 item 6). Loads an embedded model (`--base`, default
smollm2) in float32 on the CPU and takes the first `--prompts` training questions of the verbosity spec
(their answers run 5–96 tokens, like the search's passes). From one process it prints, for each batch size:

- `transformers`: `Runtime.generate` with `BLAZE_FAST=0`, i.e. `model.generate` (every row stays in the
  batch until the longest answer ends), with its wall seconds, answer tokens, batch steps and ms per step;
- `blaze`: `Runtime.generate` as shipped (stopped answers leave the batch, `clef_model.greedy`);
- whether both gave the same tokens for every prompt.

    .venv/bin/python scripts/bench_generate_cpu.py --batches 8,64 --prompts 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="smollm2")
    parser.add_argument("--batches", default="8,64", help="comma-separated batch sizes")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("BLAZE_QUIET", "1")
    import torch

    from clef_model.runtime import GenerationStats, Runtime
    from variants.spec import load_behavior

    runtime = Runtime.load(args.base, device="cpu", dtype=torch.float32)
    prompts = [q["prompt"] for q in load_behavior("verbosity").training_questions()][: args.prompts]
    print(f"# {args.base}, {len(prompts)} prompts, ≤ {args.max_new_tokens} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| batch | path | s | answer tokens | batch steps | ms / step | tokens / s | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",")]:
        answers = {}
        for path, fast in (("transformers", "0"), ("blaze", "1")):
            os.environ["BLAZE_FAST"] = fast
            runtime.generation_stats = GenerationStats()
            started = time.perf_counter()
            answers[path] = runtime.generate(prompts, max_new_tokens=args.max_new_tokens, batch_size=batch)
            seconds = time.perf_counter() - started
            stats = runtime.generation_stats
            same = "" if path == "transformers" else \
                f"{sum(a.token_ids == b.token_ids for a, b in zip(answers['transformers'], answers['blaze'], strict=True))}" \
                f"/{len(prompts)}"
            print(f"| {batch} | {path} | {seconds:.1f} | {stats.new_tokens} | {stats.steps} | "
                  f"{1000 * seconds / max(stats.steps, 1):.0f} | {stats.new_tokens / seconds:.1f} | {same} |",
                  flush=True)
            print(json.dumps({"batch": batch, "path": path, "seconds": round(seconds, 2), "tokens": stats.new_tokens,
                              "steps": stats.steps}), flush=True)
    os.environ.pop("BLAZE_FAST", None)


if __name__ == "__main__":
    main()
