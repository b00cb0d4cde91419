"""Section ``s1batch``: SystemOne throughput on requests of mixed lengths, one at a time vs length-aware batches.

Issue 15, target 2. ``--s1b-requests`` requests (default 32) of lengths drawn uniformly from
``--s1b-min``–``--s1b-max`` tokens (the canary suite's typed-decision requests, each state grown with a
``notes`` field to its length),
answered in one process by:

- ``stock``: the release's own ``systemone``, one request at a time (``BLAZE_FAST=0``);
- ``control``: the same under SDPA's math kernel (once, for agreement only: the kernel-noise floor);
- ``blaze_single``: ``Runtime.systemone``, one at a time (the fast paths' defaults);
- ``blaze_batch{N}``: ``Runtime.systemone_batch(requests, batch_size=N)``, length-aware (the default
  ``BatchingSettings`` with ``--s1b-budget`` / ``--s1b-overhead``);
- ``count_batch{N}``: the previous batching (sorted, N per forward, multi-row batches on the release's
  forward), i.e. ``Runtime.decision_probabilities(requests, batch_size=N)``, for comparison.

Each path runs one untimed pass (graph capture, kernel autotuning), then ``--s1b-repeats`` timed passes
over all requests, interleaved path by path; requests/s is the median pass. Agreement: per request, the
max |Δ| of each path's answer against stock's, beside that request's control (stock vs stock under SDPA
math). A path passes when no request moves further than the largest control figure.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Callable
from typing import Any

import torch

from scripts.bench.common import Bench, fast_setting, free_gpu, timed
from scripts.bench.models import Loaded
from scripts.bench.systemone import max_abs_diff

PHRASE = "Line item: consulting services, billed monthly. "


def _with_notes(request: dict, repeats: int) -> dict:
    """``request`` with a ``notes`` field of ``repeats`` phrases in its state (a dict state gets a key)."""
    out = json.loads(json.dumps(request))
    if isinstance(out["state"], dict):
        out["state"]["notes"] = PHRASE * repeats
    else:
        out["state"] = f"{out['state']}\n{PHRASE * repeats}"
    return out


def grown_request(tokenizer: Any, code: Any, request: dict, target: int) -> tuple[dict, int]:
    """The shortest growth of ``request``'s notes that reaches ``target`` tokens (binary search on phrases)."""
    def length(repeats: int) -> int:
        return len(code.encode_record(tokenizer, _with_notes(request, repeats)).input_ids)

    low, high = 0, 1
    while length(high) < target and high < 1 << 14:
        low, high = high, high * 2
    while low < high:
        middle = (low + high) // 2
        if length(middle) >= target:
            high = middle
        else:
            low = middle + 1
    return _with_notes(request, high), length(high)


def mixed_requests(loaded: Loaded, count: int, low: int, high: int, seed: int = 0) -> tuple[list[dict], list[int]]:
    """``count`` requests with lengths drawn uniformly from [low, high] tokens (fixed seed).

    Each is one of the canary suite's text-only typed-decision requests (chosen at random among those
    shorter than its target), its state grown with a ``notes`` field to the target length; a target below
    every request's own length gets the shortest request as it is.
    """
    from canaries.suites import default_decision_suite

    rng = random.Random(seed)
    suite = [{k: v for k, v in r.items() if k in ("model", "state", "questions")}
             for r in default_decision_suite() if not r.get("images") and not r.get("videos")]
    sized = sorted(((len(loaded.code.encode_record(loaded.tokenizer, r).input_ids), i) for i, r in enumerate(suite)))
    requests, lengths = [], []
    for _ in range(count):
        target = rng.randint(low, high)
        fitting = [i for size, i in sized if size <= target] or [sized[0][1]]
        request, tokens = grown_request(loaded.tokenizer, loaded.code, suite[rng.choice(fitting)], target)
        requests.append(request)
        lengths.append(tokens)
    return requests, lengths


def _passes(paths: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each path's full pass, ``repeats`` times, interleaved path by path."""
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            seconds[name].append(timed(run)[1])
    return seconds


def _paths(bench: Bench, loaded: Loaded, requests: list[dict], lengths: list[int], out: dict[str, Any]
           ) -> dict[str, Callable[[], Any]]:
    """The timed paths by name (each answers every request once); records each batch size's plan in ``out``."""
    from clef_model.fast import BatchingSettings, plan_batches

    options, runtime, stock_fn = bench.options, loaded.runtime, loaded.reference

    def stock() -> list[dict]:
        with fast_setting("0"):
            return [stock_fn(r) for r in requests]

    def blaze_single() -> list[dict]:
        with fast_setting(None):
            return [runtime.systemone(r) for r in requests]

    def batched(settings: BatchingSettings) -> Callable[[], list[dict]]:
        def go() -> list[dict]:
            with fast_setting(None):
                return runtime.systemone_batch(requests, batch_size=settings.max_rows, batching=settings)
        return go

    def count_batched(size: int) -> Callable[[], Any]:
        def go() -> Any:
            with fast_setting(None):
                return runtime.decision_probabilities(requests, batch_size=size)
        return go

    paths: dict[str, Callable[[], Any]] = {"stock": stock, "blaze_single": blaze_single}
    for size in options.s1b_batches:
        settings = BatchingSettings(max_rows=size, token_budget=options.s1b_budget, overhead_tokens=options.s1b_overhead,
                                    graph_tokens=options.s1b_graph_tokens)
        paths[f"blaze_batch{size}"] = batched(settings)
        out[f"plan_batch{size}"] = [len(b) for b in plan_batches(lengths, settings)]
    if options.s1b_count_batches:
        for size in options.s1b_batches:
            paths[f"count_batch{size}"] = count_batched(size)
    return paths


def run(bench: Bench, loaded: Loaded) -> None:
    """Time stock / blaze one at a time and blaze length-aware batches on mixed lengths; per-request agreement."""
    options = bench.options
    runtime = loaded.runtime
    if runtime is None:
        raise RuntimeError("s1batch needs a Runtime: use --model edit-base, random9b or a release folder")
    requests, lengths = mixed_requests(loaded, options.s1b_requests, options.s1b_min, options.s1b_max)
    out: dict[str, Any] = {"model": loaded.label, "requests": len(requests), "lengths": lengths,
                           "mean_tokens": round(statistics.mean(lengths)), "budget": options.s1b_budget,
                           "overhead_tokens": options.s1b_overhead, "graph_tokens": options.s1b_graph_tokens}
    bench.say(f"s1batch: {len(requests)} requests, {min(lengths)}–{max(lengths)} tokens (mean {out['mean_tokens']})")
    paths = _paths(bench, loaded, requests, lengths, out)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    answers: dict[str, Any] = {}
    for name, path in paths.items():  # untimed first pass: captures, autotuning; keeps the answers
        answers[name], first = timed(path)
        out.setdefault("first_pass_s", {})[name] = round(first, 2)
        bench.say(f"s1batch first pass {name}: {first:.2f}s")
    seconds = _passes(paths, options.s1b_repeats)
    out["req_per_s"] = {name: round(len(requests) / statistics.median(s), 2) for name, s in seconds.items()}
    out["pass_s"] = {name: [round(x, 3) for x in s] for name, s in seconds.items()}
    if torch.cuda.is_available():
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["fast_failed"] = runtime.__dict__.get("_fast_failed")
    bench.say(f"s1batch req/s: {out['req_per_s']}")
    out["agreement"] = _agreement(bench, answers, requests, loaded.reference)
    bench.results.s1batch = out
    free_gpu()


def _agreement(bench: Bench, answers: dict[str, Any], requests: list[dict], stock_fn: Callable[[dict], dict]
               ) -> dict[str, Any]:
    """Per request: each path's max |Δ| against stock, beside stock vs stock under SDPA math (the control)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stock = answers["stock"]
    with fast_setting("0"), sdpa_kernel([SDPBackend.MATH]):
        control = [max_abs_diff(s, stock_fn(r)) for s, r in zip(stock, requests, strict=True)]
    result: dict[str, Any] = {"control_per_request": [round(c, 5) for c in control],
                              "control_max": round(max(control), 5)}
    for name, got in answers.items():
        if name == "stock" or name.startswith("count_batch"):
            continue  # count_batch returns unrounded probabilities; timing only
        diffs = [max_abs_diff(s, g) for s, g in zip(stock, got, strict=True)]
        result[name] = {"max": round(max(diffs), 5), "per_request": [round(d, 5) for d in diffs],
                        "over_own_control": sum(d > c for d, c in zip(diffs, control, strict=True)),
                        "within_control_max": max(diffs) <= max(control)}
    bench.say(f"s1batch agreement: control max {result['control_max']}; "
              + ", ".join(f"{k} max {v['max']}" for k, v in result.items() if isinstance(v, dict)))
    return result
