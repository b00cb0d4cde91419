"""Length-aware batching of SystemOne requests: which requests share a forward pass.

Why: a batched forward pads every row to its longest request. Cut by count alone, a batch of mixed
lengths spends most of its compute on padding, and batched SystemOne ran slower than one request at a
time (issue 15: 32 requests of 788–4,140 tokens, 9.6 req/s one at a time, 6.0 req/s at batch 32).

The plan sorts requests by length and groups neighbours while three limits hold:

- rows ≤ ``max_rows`` (the caller's batch size);
- padded tokens = rows × padded longest ≤ ``token_budget`` (bounds activation memory and keeps a batch
  from growing past the point where the forward is compute-bound anyway);
- the padding a batch adds over running its requests one at a time (each padded to its own length
  bucket) is at most ``overhead_tokens`` per extra row. This is the break-even of a simple cost model,
  time(forward) ≈ a + b · padded tokens: merging R requests saves (R − 1) · a of fixed per-forward cost
  (launches, head, host syncs) and costs b · (added padding), so it pays while the added padding stays
  under (R − 1) · a / b tokens. On the 9B fixture's one-at-a-time latencies (issue 15: 33 ms at 445
  tokens … 135 ms at 3,378) a / b ≈ 270–450 tokens; the default 256 stays on the safe side.

A request that ends up alone runs the one-at-a-time path, so batching never changes a lone request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clef_model.errors import BlazeError


@dataclass(frozen=True)
class BatchingSettings:
    """Limits of a length-aware batch plan (see the module docstring for why each exists).

    ``granularity`` is the length bucket of the padded forward (64 tokens, as the CUDA-graphed backbone
    uses); ``graph_tokens`` is the largest padded batch (rows × bucket) replayed from a CUDA graph:
    above it the batch runs eagerly, because its kernels are long enough to hide their launches and a
    graph per (rows, bucket) shape would only cost capture time and memory.
    """

    max_rows: int = 8
    token_budget: int = 8192
    overhead_tokens: int = 256
    granularity: int = 64
    graph_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_rows", "token_budget", "granularity"):
            if getattr(self, name) < 1:
                raise BlazeError(f"batching: {name} must be at least 1 (got {getattr(self, name)}).")
        for name in ("overhead_tokens", "graph_tokens"):
            if getattr(self, name) < 0:
                raise BlazeError(f"batching: {name} must not be negative (got {getattr(self, name)}).")


def padded_length(length: int, granularity: int) -> int:
    """``length`` rounded up to a multiple of ``granularity`` (the bucket a padded forward runs at)."""
    return -(-max(length, 1) // granularity) * granularity


def plan_batches(lengths: Sequence[int], settings: BatchingSettings) -> list[list[int]]:
    """Indices of ``lengths`` grouped into batches, shortest first; every index appears exactly once.

    Each batch lists its requests in ascending length. A batch of more than one request satisfies
    ``len(batch) <= max_rows``, ``len(batch) * padded longest <= token_budget`` and ``len(batch) *
    padded longest - sum(padded lengths) <= (len(batch) - 1) * overhead_tokens``. A request that fits
    no batch (e.g. longer than the budget) is a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    own = 0  # sum of the current batch's own padded lengths (what one-at-a-time would run)
    for index in order:
        padded = padded_length(lengths[index], settings.granularity)
        rows = len(current) + 1
        tokens = rows * padded  # ascending order: this request is the batch's longest
        fits = (rows <= settings.max_rows and tokens <= settings.token_budget
                and tokens - (own + padded) <= (rows - 1) * settings.overhead_tokens)
        if current and not fits:
            batches.append(current)
            current, own = [], 0
        current.append(index)
        own += padded
    if current:
        batches.append(current)
    return batches
