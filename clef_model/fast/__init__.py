"""Fast inference paths for Qwen3.5 backbones: static-shape forward, static caches, CUDA graphs.

Why: the stock transformers path spends most of a SystemOne request and almost all of a decode step in
Python and kernel-launch overhead (BENCHMARKS.md: 70–85 ms for a ~1k-token SystemOne request whose
matmul floor is ~20 ms; ~20 tokens/s at batch 1 for a decode step whose weight-streaming floor is
~4 ms). This package runs the same math on the same modules (so live weight edits such as
``Patch.applied`` are seen) with shapes fixed in advance, which lets a whole forward or a whole greedy
decode step be captured once as a CUDA graph and replayed with one launch.

Modules, in import order:

- :mod:`~clef_model.fast.support` — which models it runs (:func:`is_supported`), their decoder and
  shapes, the optional flash-linear-attention kernels.
- :mod:`~clef_model.fast.engine` — :class:`QwenEngine`: a re-implementation of the Qwen3.5 text decoder
  forward over the loaded modules: ``hidden_states`` (no cache; right padding is harmless because
  every mixer is causal) and a prefill/step pair over :class:`StaticCache` (full-attention K/V
  buffers, Gated DeltaNet conv and recurrent states). On CUDA the Gated DeltaNet prefill uses
  flash-linear-attention's chunked kernel when it is installed; elsewhere a float32 recurrence.
- :mod:`~clef_model.fast.graphs` — :class:`GraphedBackbone` (``hidden_states`` for batch 1, padded to a
  length bucket and replayed from a CUDA graph captured once per bucket; eager on CPU) and
  :class:`StaticGreedyDecoder` (greedy generation with a CUDA-graph decode step per batch size).
- :mod:`~clef_model.fast.head` — :func:`head_logits`: the release's joint head vectorised, no host
  syncs, but not bit-compatible in bf16, so only on request.
- :mod:`~clef_model.fast.systemone` — :class:`FastSystemOne`: the release's ``systemone`` answer with
  the backbone swapped for :class:`GraphedBackbone`.
- :mod:`~clef_model.fast.batching` — :func:`plan_batches`: length-aware SystemOne batches (sorted, cut
  by a padded-token budget and a padding-waste bound) for ``Runtime.systemone_batch``.
- :mod:`~clef_model.fast.hooks` — what ``clef_model.runtime.Runtime`` calls (:func:`clef_logits`,
  :func:`clef_logits_rows`, :func:`greedy_rows`); each returns None when the reference path should answer.

Equivalence with the reference path is checked by ``tests/test_fast.py`` (CPU, float32 fixtures) and
by ``scripts/bench`` (GPU, bf16, 9B shapes).
"""

from clef_model.fast.batching import BatchingSettings, padded_length, plan_batches
from clef_model.fast.cache import StaticCache
from clef_model.fast.engine import QwenEngine
from clef_model.fast.graphs import GraphedBackbone, StaticGreedyDecoder, default_buckets
from clef_model.fast.head import (
    HeadPlan,
    head_logits,
    head_plan,
    known_head,
    vector_head_requested,
)
from clef_model.fast.hooks import (
    clef_logits,
    clef_logits_rows,
    compile_requested,
    compiled_engine,
    enabled,
    greedy_rows,
)
from clef_model.fast.support import is_supported, text_parts
from clef_model.fast.systemone import FastSystemOne

__all__ = [
    "BatchingSettings",
    "FastSystemOne",
    "GraphedBackbone",
    "HeadPlan",
    "QwenEngine",
    "StaticCache",
    "StaticGreedyDecoder",
    "clef_logits",
    "clef_logits_rows",
    "compile_requested",
    "compiled_engine",
    "default_buckets",
    "enabled",
    "greedy_rows",
    "head_logits",
    "head_plan",
    "is_supported",
    "known_head",
    "padded_length",
    "plan_batches",
    "text_parts",
    "vector_head_requested",
]
