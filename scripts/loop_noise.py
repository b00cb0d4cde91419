"""The kernel-noise control for loops: how many answers of the *unedited* base change, and how many start or
stop looping, when nothing but the batch changes.

Issue 11's bars ask for "no new loops" on the held-out prompts, and the search's training-question check fails
a point on a single new loop in 134 answers. On a GPU in bfloat16 the same prompt gives slightly different
logits in another batch (other padding, other kernels), so a greedy answer that sits near a tie or near a
repetition can change with no edit at all. This script measures that floor on the base: it generates greedy
answers to the verbosity spec's training and validation questions (never the held-out ones) at several batch
sizes, and with transformers' own `generate` (``BLAZE_FAST=0``), and compares every run with the first:
answers whose tokens differ, loops in each run (``canaries.freeform.find_loop``), and loops that appear or
disappear. A loop flip here is one that no edit caused.

    python scripts/loop_noise.py --base smollm2 --device cuda --batches 16,1,7 --reference-path
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class RunSummary:
    """One generation run of the base, compared with the first run."""

    label: str
    seconds: float
    answers: int
    loops: int
    at_limit: int
    differ: int = 0            # answers whose tokens differ from the first run's
    loops_new: int = 0         # loops here that the first run did not have
    loops_gone: int = 0        # loops of the first run that are not here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="smollm2", help="an embedded alias or a release folder")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="compute dtype (default: blaze's: float32 on the CPU and for small plain models on CUDA)")
    parser.add_argument("--batches", default="16,1,7", help="comma-separated batch sizes; the first is the reference")
    parser.add_argument("--reference-path", action="store_true",
                        help="also run transformers' generate (BLAZE_FAST=0) at the first batch size")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=0, help="use only the first N questions (0: all)")
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--tokens", default=None,
                        help="write the first run's answers (token ids, in prompt order) here, to compare two "
                             "machines' runs with --compare")
    parser.add_argument("--compare", default=None,
                        help="a --tokens file of another run: count the answers whose tokens differ from it")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("BLAZE_QUIET", "1")

    from canaries.freeform import find_loop
    from clef_model.runtime import Runtime
    from variants.spec import load_behavior

    spec = load_behavior("verbosity")
    taken = {repr(item["prompt"]) for item in spec.heldout_items()}
    prompts: list = []
    for item in spec.training_questions() + spec.validation_items():
        if repr(item["prompt"]) not in taken and item["prompt"] not in prompts:
            prompts.append(item["prompt"])
    if args.prompts:
        prompts = prompts[: args.prompts]
    import torch

    runtime = Runtime.load(args.base, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    print(f"# {args.base} on {runtime.device} in {runtime.dtype}: {len(prompts)} questions (verbosity training + "
          f"validation, no held-out item), ≤ {args.max_new_tokens} tokens")

    runs = [(f"blaze batch {b}", int(b), "1") for b in args.batches.split(",")]
    if args.reference_path:
        runs.insert(1, (f"transformers generate, batch {runs[0][1]}", runs[0][1], "0"))
    first: list | None = None
    summaries: list[RunSummary] = []
    for label, batch, fast in runs:
        os.environ["BLAZE_FAST"] = fast
        started = time.perf_counter()
        answers = runtime.generate(prompts, max_new_tokens=args.max_new_tokens, batch_size=batch)
        seconds = time.perf_counter() - started
        loops = [find_loop(a.token_ids) is not None for a in answers]
        summary = RunSummary(label=label, seconds=round(seconds, 1), answers=len(answers), loops=sum(loops),
                             at_limit=sum(len(a.token_ids) >= args.max_new_tokens for a in answers))
        if first is None:
            first = [(a.token_ids, looped) for a, looped in zip(answers, loops, strict=True)]
            _save_or_compare(args, prompts, [list(a.token_ids) for a in answers])
        else:
            pairs = list(zip(answers, loops, first, strict=True))
            summary = replace(summary, differ=sum(a.token_ids != ids for a, _, (ids, _) in pairs),
                              loops_new=sum(now and not then for _, now, (_, then) in pairs),
                              loops_gone=sum(then and not now for _, now, (_, then) in pairs))
        summaries.append(summary)
        print(json.dumps(asdict(summary)), flush=True)
    os.environ.pop("BLAZE_FAST", None)
    print("| run | s | loops | at limit | answers differing from the first run | loops new / gone |")
    print("|---|---|---|---|---|---|")
    for s in summaries:
        print(f"| {s.label} | {s.seconds} | {s.loops} of {s.answers} | {s.at_limit} | {s.differ} | "
              f"{s.loops_new} / {s.loops_gone} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(s) for s in summaries], handle, indent=1)


def _save_or_compare(args: argparse.Namespace, prompts: list, tokens: list[list[int]]) -> None:
    """Write the first run's tokens (--tokens) and count how many differ from another run's (--compare)."""
    if args.tokens:
        with open(args.tokens, "w") as handle:
            json.dump({"prompts": prompts, "tokens": tokens}, handle)
    if args.compare:
        with open(args.compare) as handle:
            other = json.load(handle)
        if other["prompts"] != prompts:
            raise SystemExit(f"{args.compare} holds answers to other prompts: compare runs of the same questions")
        differ = sum(mine != theirs for mine, theirs in zip(tokens, other["tokens"], strict=True))
        print(f"# against {args.compare}: {differ} of {len(tokens)} answers differ", flush=True)


if __name__ == "__main__":
    main()
