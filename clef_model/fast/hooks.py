"""Runtime hooks: ``clef_model.runtime.Runtime`` calls these for SystemOne and ``generate``.

Each returns None when the reference path should run instead (fast path off, unsupported model, media
inputs, batch shapes it does not serve). The engine, backbone and decoder they build are kept on the
runtime (``runtime.__dict__["_fast_…"]``), so a runtime pays for graph capture once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from clef_model.errors import BlazeError
from clef_model.fast.engine import QwenEngine
from clef_model.fast.graphs import GraphedBackbone, StaticGreedyDecoder
from clef_model.fast.head import head_logits, head_plan, vector_head_requested
from clef_model.fast.support import is_supported


def enabled(runtime: Any) -> bool:
    """Whether ``runtime`` should use the fast paths.

    ``BLAZE_FAST=0`` turns them off, ``BLAZE_FAST=1`` turns them on on any device (tests use this on the
    CPU); by default they run on CUDA only, for Qwen3.5 backbones.
    """
    from clef_model.env import fast

    setting = fast()
    if setting is False:
        return False
    if setting is None and getattr(runtime, "device", torch.device("cpu")).type != "cuda":
        return False
    cached = runtime.__dict__.get("_fast_supported")
    if cached is None:
        cached = is_supported(runtime.model)
        runtime.__dict__["_fast_supported"] = cached
    return cached


def _engine(runtime: Any) -> QwenEngine:
    engine = runtime.__dict__.get("_fast_engine")
    if engine is None:
        engine = QwenEngine(runtime.model)
        runtime.__dict__["_fast_engine"] = engine
    return engine


def greedy_rows(runtime: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                stop_ids: Sequence[int]) -> list[list[int]] | None:
    """New token ids per prompt (each row ends at its first stop id, inclusive), or None for the reference.

    Used by ``Runtime.generate``: same greedy tokens as ``model.generate(do_sample=False)``, with static
    caches and a CUDA-graph decode step. The decoder (and its caches) is kept on the runtime and
    regrown in steps of 1024 positions when a longer prompt arrives.
    """
    if not enabled(runtime) or not prompts:
        return None
    try:
        needed = max(len(p) for p in prompts) + max_new_tokens
        decoder = runtime.__dict__.get("_fast_decoder")
        if decoder is None or decoder.max_len < needed:
            runtime.__dict__["_fast_decoder"] = None  # free the old caches before allocating larger ones
            decoder = StaticGreedyDecoder(runtime.model, max_len=1024 * math.ceil(needed / 1024),
                                          engine=_engine(runtime))
            runtime.__dict__["_fast_decoder"] = decoder
        # pad the batch to a power of two with copies of its first prompt: at most log2(batch) decode
        # states and graphs stay allocated, whatever chunk sizes the caller produces
        width = 1 << (len(prompts) - 1).bit_length()
        rows = decoder.generate(list(prompts) + [prompts[0]] * (width - len(prompts)), max_new_tokens,
                                stop_ids=stop_ids)
        return rows[: len(prompts)]
    except BlazeError:
        raise
    except Exception as error:  # noqa: BLE001 - a fast-path failure must never break generation
        _give_up(runtime, "generate", error)
        return None


def _give_up(runtime: Any, what: str, error: Exception) -> None:
    """Turn the fast paths off for ``runtime`` after a failure, say so once, keep the reason."""
    import warnings

    runtime.__dict__["_fast_supported"] = False
    runtime.__dict__["_fast_failed"] = f"{what}: {type(error).__name__}: {error}"
    warnings.warn(f"blaze fast path disabled ({runtime.__dict__['_fast_failed']}); using the reference path", stacklevel=2)


def compile_requested() -> bool:
    """Whether ``BLAZE_FAST_COMPILE=1`` asks for the compiled SystemOne backbone (faster, not bit-compatible)."""
    from clef_model.env import fast_compile

    return fast_compile()


def compiled_engine(model: torch.nn.Module) -> QwenEngine:
    """A ``QwenEngine`` whose forward goes through ``torch.compile`` (inductor; one graph per length bucket).

    Inductor fuses the norms, gates and casts between the matmuls. Measured on an H200 at 1,064 tokens
    (BENCHMARKS.md, run J): SystemOne 37.9 ms median against 49.5 ms for the exact default. Its reductions
    are not transformers' order of operations, so hidden states and answers move. On random 9B weights
    they move about as far as the stock path moves under another attention kernel, and near-ties can
    flip. That is why it is opt-in: check a model with ``blaze canary`` (decision drift) before serving
    it this way.
    """
    import torch._inductor.config as inductor_config

    engine = QwenEngine(model)
    options: dict[str, Any] = (
        {"emulate_precision_casts": True} if hasattr(inductor_config, "emulate_precision_casts") else {})
    # the compiled forward replaces the bound method on this one engine, on purpose
    engine._run = torch.compile(engine._run, dynamic=False, options=options)  # type: ignore[method-assign]
    return engine


def _backbone(runtime: Any) -> GraphedBackbone:
    """The runtime's graphed backbone (built on first use; ``BLAZE_FAST_COMPILE=1`` compiles it first)."""
    backbone = runtime.__dict__.get("_fast_backbone")
    if backbone is None:
        pad = runtime.tokenizer.pad_token_id if runtime.tokenizer.pad_token_id is not None else 0
        engine = compiled_engine(runtime.model) if compile_requested() else _engine(runtime)
        backbone = GraphedBackbone(engine, pad_token_id=pad)
        runtime.__dict__["_fast_backbone"] = backbone
    return backbone


def clef_logits_rows(runtime: Any, batch: dict, graph_tokens: int = 2048) -> list | None:
    """``ClefModel(batch)`` for a length-aware batch of text-only records through the fast backbone; else None.

    Used by ``Runtime.systemone_batch`` for batches of two or more requests of similar length
    (:func:`clef_model.fast.batching.plan_batches`): the rows run padded to one length bucket, from a
    CUDA graph when the padded batch has at most ``graph_tokens`` tokens, and the release's own joint head
    scores each row up to its attention mask, as in the release's batched forward.
    """
    clef = getattr(runtime, "clef", None)
    if clef is None or batch.get("media") or not enabled(runtime):
        return None
    if batch["input_ids"].shape[0] == 1:
        return clef_logits(runtime, batch)
    try:
        backbone = _backbone(runtime)
        with torch.inference_mode():
            hidden = backbone.rows(batch["input_ids"], graph_tokens=graph_tokens)
            return clef.head(hidden, batch["input_ids"], batch["attention_mask"], batch["records"],
                             backbone.engine.lm_head.weight)
    except Exception as error:  # noqa: BLE001 - a fast-path failure must never break SystemOne
        _give_up(runtime, "systemone batch", error)
        return None


def clef_logits(runtime: Any, batch: dict) -> list | None:
    """``ClefModel(batch)`` for a batch of one text-only record, backbone from a CUDA graph; else None.

    Used by ``Runtime`` for SystemOne requests; the release's own joint head scores the hidden states.
    ``BLAZE_FAST_COMPILE=1`` (read when the first request builds the backbone) compiles it first
    (`compiled_engine`).
    """
    clef = getattr(runtime, "clef", None)
    if clef is None or batch.get("media") or batch["input_ids"].shape[0] != 1 or not enabled(runtime):
        return None
    backbone = _backbone(runtime)
    vector = vector_head_requested(getattr(runtime, "release_code", None))
    try:
        with torch.inference_mode():
            plan = head_plan(batch["records"][0], backbone.engine.device) if vector else None
            hidden = backbone(batch["input_ids"])
            if plan is not None:
                return [head_logits(clef.head, hidden[0], plan, backbone.engine.lm_head.weight)]
            return clef.head(hidden, batch["input_ids"], batch["attention_mask"], batch["records"],
                             backbone.engine.lm_head.weight)
    except Exception as error:  # noqa: BLE001 - a fast-path failure must never break SystemOne
        _give_up(runtime, "systemone", error)
        return None
