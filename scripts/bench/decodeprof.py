"""Section ``decodeprof``: where a batch-1 greedy decode step's time goes (issue 15, target 7).

The shipped decoder (``clef_model.fast.StaticGreedyDecoder``: static caches, one CUDA graph per batch
size) ran at 8.46 ms per step on the 9B shapes (106 tokens/s); the weight-streaming floor is ≈ 3.8 ms.
This section measures, on one prompt at batch 1:

- the graph replay's ms/step (CUDA events over ``--prof-steps`` replays), and the floor: the bytes a step
  must read (decoder layers' parameters + ``lm_head``) at the device-copy bandwidth of the ``env`` section
  (4.2 TB/s when that section did not run);
- a torch.profiler trace of the same step run eagerly (kernel by kernel) and of graph replays: GPU time
  and kernel count per step by category (matmul, attention, DeltaNet recurrence, conv, norm/elementwise,
  copies/casts, other), and the top kernels. The gap between the replay's wall time and the sum of its
  kernels' GPU time is what the graph leaves idle between kernels;
- the same step through the inductor-compiled backbone (``clef_model.fast.hooks.compiled_engine``) in the same
  CUDA graph: replay ms, kernels by category, and how many of 64 greedy tokens match the exact decoder's.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any

import torch

from scripts.bench.common import Bench, free_gpu
from scripts.bench.models import Loaded

CATEGORIES = (  # first match wins; kernel names of cuBLAS/cuDNN/triton/fla/torch on an H200
    ("matmul", re.compile(r"nvjet|gemm|cutlass|sm90_xmma|gemv|matmul", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|softmax", re.I)),
    ("deltanet", re.compile(r"fused_recurrent|gated_delta|chunk_|recurrent", re.I)),
    ("conv", re.compile(r"conv", re.I)),
    ("copy/cast", re.compile(r"copy|cast|convert|to_copy|memcpy|memset|fill", re.I)),
    ("reduce", re.compile(r"reduce|norm|rms|triton_red|mean|sum|argmax", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi", re.I)),
)


def category(name: str) -> str:
    """The category of a kernel name (see CATEGORIES); ``other`` when none matches."""
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def _device_us(event: Any) -> float:
    """GPU microseconds of a profiler average (the attribute was renamed across torch versions)."""
    for attr in ("device_time_total", "cuda_time_total", "self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value:
            return float(value)
    return 0.0


def kernel_table(prof: Any, steps: int) -> dict[str, Any]:
    """Per-step GPU ms and kernel counts by category, and the 15 costliest kernels, from a profiler run."""
    by_cat: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    kernels = []
    for event in prof.key_averages():
        if getattr(event, "device_type", None) is not None and "CUDA" not in str(event.device_type):
            continue
        us = _device_us(event)
        if us <= 0 or event.key.startswith(("cudaLaunch", "cudaGraphLaunch", "ProfilerStep")):
            continue
        if event.key.startswith("aten::") or event.key.startswith("cuda"):
            continue  # CPU-side ops carry their kernels' time too: count kernels only
        cat = category(event.key)
        by_cat[cat][0] += us / 1000 / steps
        by_cat[cat][1] += event.count / steps
        kernels.append((us / 1000 / steps, event.count / steps, event.key[:110], cat))
    kernels.sort(reverse=True)
    total = sum(v[0] for v in by_cat.values())
    return {"gpu_ms_per_step": round(total, 3),
            "kernels_per_step": round(sum(v[1] for v in by_cat.values()), 1),
            "by_category": {k: {"ms": round(v[0], 3), "kernels": round(v[1], 1)}
                            for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1][0])},
            "top": [{"ms": round(ms, 4), "per_step": round(n, 1), "name": name, "category": cat}
                    for ms, n, name, cat in kernels[:15]]}


def _replay_ms(graph: Any, steps: int) -> float:
    """Median ms of one graph replay over ``steps`` replays (CUDA events)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@torch.inference_mode()
def run(bench: Bench, loaded: Loaded) -> None:
    """Replay ms/step against the weight-streaming floor, and the step's kernels by category."""
    from torch.profiler import ProfilerActivity, profile

    from clef_model.fast import QwenEngine, StaticGreedyDecoder
    from clef_model.fast.support import text_parts

    if bench.device != "cuda":
        raise RuntimeError("decodeprof profiles CUDA kernels: run it on a GPU")
    steps = bench.options.prof_steps
    engine = QwenEngine(loaded.backbone)
    decoder = StaticGreedyDecoder(loaded.backbone, max_len=2048, engine=engine)
    prompt = loaded.tokenizer("Write a short story about a lighthouse keeper who finds a map.")["input_ids"]
    decoder.generate([prompt], 8)  # prefill, warm-up, graph capture for batch 1
    state = decoder._state(1)
    graph = decoder._graph(state)
    text, lm_head = text_parts(loaded.backbone)
    weight_bytes = sum(p.numel() * p.element_size() for p in text.layers.parameters())
    weight_bytes += lm_head.weight.numel() * lm_head.weight.element_size()
    bandwidth = float((bench.results.env or {}).get("copy_tb_s") or 4.2)
    replay = _replay_ms(graph, steps)
    out: dict[str, Any] = {"model": loaded.label, "prompt_tokens": len(prompt), "replay_ms_per_step": round(replay, 3),
                           "tokens_per_s": round(1000 / replay, 1), "weight_gb_per_step": round(weight_bytes / 1e9, 2),
                           "copy_tb_s": bandwidth, "floor_ms": round(weight_bytes / (bandwidth * 1e12) * 1000, 3),
                           "fla_recurrent": engine._recurrent is not None}
    prof_steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as eager:
        for _ in range(prof_steps):
            decoder._step_inplace(state)
        torch.cuda.synchronize()
    out["eager_step"] = kernel_table(eager, prof_steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as graphed:
        for _ in range(prof_steps):
            graph.replay()
        torch.cuda.synchronize()
    out["graph_replay"] = kernel_table(graphed, prof_steps)
    busy = out["graph_replay"]["gpu_ms_per_step"]
    out["graph_idle_ms_per_step"] = round(replay - busy, 3) if busy else None
    bench.say(f"decodeprof: {replay:.2f} ms/step (floor {out['floor_ms']} ms); kernels "
              f"{out['eager_step']['kernels_per_step']}/step; by category {out['eager_step']['by_category']}")
    bench.results.decode_profile = out   # stored first: the compiled step below may fail on its own
    try:
        out["compiled"] = _compiled_step(loaded, prompt, decoder, steps, prof_steps)
    except Exception as error:  # noqa: BLE001 - reported in the results; the exact figures above stand
        out["compiled"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    bench.say(f"decodeprof: compiled step {out['compiled']}")
    free_gpu()


def _compiled_step(loaded: Loaded, prompt: list[int], exact: Any, steps: int, prof_steps: int) -> dict[str, Any]:
    """The same batch-1 step with the backbone through ``torch.compile`` (``clef_model.fast.hooks.compiled_engine``,
    what ``BLAZE_FAST_COMPILE=1`` gives SystemOne), captured in the decoder's CUDA graph: replay ms, kernels
    per replay, and how many of 64 greedy tokens match the exact decoder's. Inductor fuses the norm, gate and
    cast chains between the matmuls, the kernels that the profile says hold a third of the step."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from clef_model.fast import StaticGreedyDecoder
    from clef_model.fast.hooks import compiled_engine

    started = time.perf_counter()
    decoder = StaticGreedyDecoder(loaded.backbone, max_len=2048, engine=compiled_engine(loaded.backbone))
    decoder.generate([prompt], 8)
    compile_s = time.perf_counter() - started
    state = decoder._state(1)
    graph = decoder._graph(state)
    replay = _replay_ms(graph, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as graphed:
        for _ in range(prof_steps):
            graph.replay()
        torch.cuda.synchronize()
    table = kernel_table(graphed, prof_steps)
    ours, theirs = decoder.generate([prompt], 64)[0], exact.generate([prompt], 64)[0]
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return {"replay_ms_per_step": round(replay, 3), "tokens_per_s": round(1000 / replay, 1),
            "compile_s": round(compile_s, 1), "kernels_per_step": table["kernels_per_step"],
            "gpu_ms_per_step": table["gpu_ms_per_step"], "by_category": table["by_category"],
            "tokens_equal_prefix_of_64": same}
