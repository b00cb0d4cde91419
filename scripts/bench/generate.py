"""Section ``generate``: free-form greedy generation, tokens/s, stock vs blaze's fast decoder.

``--gen-tokens`` new tokens, no early stop: stock ``generate`` (KV cache on, left padding) vs
``clef_model.fast.StaticGreedyDecoder`` (static caches, CUDA-graph decode step) at batch 1 and at
``--gen-batches`` (the fast decoder also at ``--fast-extra-batches``), with token agreement; then the
product path, ``Runtime.generate`` with its hooks off and on.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from scripts.bench.common import Bench, fast_setting, free_gpu, timed
from scripts.bench.models import Loaded

GEN_PROMPTS = [
    "What is the speed of light?", "Explain how a refrigerator works.", "Write a haiku about autumn.",
    "Why is the sky blue?", "List three uses of copper.", "Summarise the plot of Hamlet.",
    "How do vaccines work?", "What causes tides?",
]


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of one user message through the chat template (generation prompt, thinking off)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        enable_thinking=False, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def stock_generate(bench: Bench, loaded: Loaded, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Exactly ``new_tokens`` greedy tokens per prompt from transformers' ``generate`` (left padding)."""
    pad = loaded.tokenizer.pad_token_id or 0
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long, device=bench.device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as Runtime.generate does
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    with torch.inference_mode():
        out = loaded.backbone.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=pad)
    return out[:, longest:].tolist()


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where two token rows differ (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def run(bench: Bench, loaded: Loaded) -> None:
    """Tokens/s of stock and fast greedy generation at each batch size, and of ``Runtime.generate``."""
    n = bench.options.gen_tokens
    prompts = [chat_ids(loaded.tokenizer, p) for p in GEN_PROMPTS]
    out: dict[str, Any] = {"model": loaded.label, "new_tokens": n, "prompt_tokens": [len(p) for p in prompts]}
    stock, stock_rows = _stock(bench, loaded, prompts)
    out["stock"] = stock
    if 1 in stock_rows and len(stock_rows) > 1:
        out["stock_batch1_vs_batched_first_divergence"] = first_divergence(stock_rows[1][0],
                                                                           stock_rows[max(stock_rows)][0])
    out["fast"] = {}
    try:
        _fast(bench, loaded, prompts, stock_rows, out)
    except Exception:  # noqa: BLE001 - record and go on with the other figures
        out["fast_error"] = bench.failed("generate fast")
    if loaded.runtime is not None:
        try:
            out["runtime_generate_batch8"] = _runtime_generate(bench, loaded)
        except Exception:  # noqa: BLE001 - record and go on with the other figures
            out["runtime_generate_error"] = bench.failed("Runtime.generate")
    bench.results.generate = out
    free_gpu()


def _stock(bench: Bench, loaded: Loaded, prompts: list[list[int]]) -> tuple[dict[str, Any], dict[int, list]]:
    """Stock ``generate`` at batch 1 and each ``--gen-batches`` size up to ``--stock-batch-limit``."""
    n = bench.options.gen_tokens
    stock: dict[str, Any] = {}
    stock_rows: dict[int, list[list[int]]] = {}
    stock_generate(bench, loaded, prompts[:1], 4)  # warm-up
    for batch in (1, *bench.options.gen_batches):
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        times = []
        for _ in range(2 if batch == 1 else 1):
            result, dt = timed(partial(stock_generate, bench, loaded, rows, n))
            times.append(dt)
        stock_rows[batch] = result
        stock[str(batch)] = {"seconds": round(min(times), 3), "tokens_per_s": round(batch * n / min(times), 1)}
        bench.say(f"generate stock batch {batch}: {stock[str(batch)]}")
        if batch >= bench.options.stock_batch_limit:
            break
    return stock, stock_rows


def _fast(bench: Bench, loaded: Loaded, prompts: list[list[int]], stock_rows: dict[int, list],
          out: dict[str, Any]) -> None:
    """``StaticGreedyDecoder`` at each batch size into ``out["fast"]`` (kept if a later batch fails): best
    of 3, the first call (with graph capture), prefill, decode ms/step, agreement with the stock rows."""
    from clef_model.fast import StaticGreedyDecoder

    n = bench.options.gen_tokens
    decoder = StaticGreedyDecoder(loaded.backbone, max_len=max(len(p) for p in prompts) + n + 64)
    out["fast_uses_fla"] = decoder.engine.uses_fla
    for batch in (1, *bench.options.gen_batches, *bench.options.fast_extra_batches):
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        _, first = timed(partial(decoder.generate, rows, n))  # includes graph capture for this batch size
        times: list[float] = []
        result: list[list[int]] = []
        for _ in range(3):
            result, dt = timed(partial(decoder.generate, rows, n))
            times.append(dt)
        _, pre = timed(partial(decoder.generate, rows, 1))  # 1 new token: prefill + overhead
        best = min(times)
        entry: dict[str, Any] = {"seconds": round(best, 3), "tokens_per_s": round(batch * n / best, 1),
                 "first_call_s": round(first, 2), "prefill_s": round(pre, 4),
                 "decode_ms_per_step": round((best - pre) / max(n - 1, 1) * 1000, 3)}
        if batch in stock_rows:
            ref = stock_rows[batch]
            entry["identical_rows"] = f"{sum(a == b for a, b in zip(ref, result, strict=True))}/{len(ref)}"
            entry["first_divergence_min"] = min(first_divergence(a, b) for a, b in zip(ref, result, strict=True))
        out["fast"][str(batch)] = entry
        bench.say(f"generate fast batch {batch}: {entry}")


def _runtime_generate(bench: Bench, loaded: Loaded) -> dict[str, Any]:
    """The product path: ``Runtime.generate`` (chat template, stops) on 8 prompts at batch 8, hooks off vs on."""
    n = bench.options.gen_tokens
    rt = loaded.runtime
    product: dict[str, Any] = {}
    for label, setting in (("stock", "0"), ("fast", None)):
        with fast_setting(setting):
            rt.generate(GEN_PROMPTS[:2], max_new_tokens=8, batch_size=8)  # warm-up / graph capture
            gens, dt = timed(lambda: rt.generate(GEN_PROMPTS, max_new_tokens=n, batch_size=8))
        made = sum(g.new_tokens for g in gens)
        product[label] = {"seconds": round(dt, 3), "new_tokens": made, "tokens_per_s": round(made / dt, 1),
                          "token_ids": [g.token_ids for g in gens]}
    same = sum(a == b for a, b in zip(product["stock"].pop("token_ids"), product["fast"].pop("token_ids"), strict=True))
    product["identical_answers"] = f"{same}/{len(GEN_PROMPTS)}"
    product["fast_failed"] = rt.__dict__.get("_fast_failed")
    bench.say(f"Runtime.generate batch 8: {product}")
    return product
