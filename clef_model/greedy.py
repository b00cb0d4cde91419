"""Greedy decoding of a left-padded batch that drops each answer from the batch once it has stopped.

Why hand-written: transformers' ``generate`` keeps every row of a batch in each decode step until the
longest answer ends, so a batch of 64 chat answers of 10–96 tokens spends most of its steps on rows that
already stopped. On the CPU (where blaze's main job runs) a decode step costs in proportion to the rows it
carries once the batch is large, so those rows are paid for. Here a stopped row leaves the batch, and its
KV-cache rows with it (the cache's own ``batch_select_indices``). The arithmetic per row is the same as
``generate``'s greedy path: the same position ids from the attention mask, the argmax of the last logits.
Measured: the same tokens as ``generate`` on SmolLM2, Qwen2.5-Coder and Gemma 3 (tests/test_greedy.py and
BENCHMARKS.md "The README's main job, round 5").

Used for plain causal LMs only. Clef's hybrid cache (Gated DeltaNet states) goes through the release's own
``generate`` or blaze's CUDA-graph decoder (`clef_model.fast`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def left_padded(encoded: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a batch, each row right-aligned (left padding)."""
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def _cache_name(model: Any) -> str:
    """The forward's keyword for the KV cache: ``cache`` in recent transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _plain_layers() -> tuple[type, ...]:
    """Cache layer types that hold only keys and values, whose rows `batch_select_indices` drops whole."""
    try:
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
    except ImportError:  # an older transformers: no per-layer cache classes, so no dropping
        return ()
    return (DynamicLayer, DynamicSlidingWindowLayer)


def can_drop_rows(cache: Any) -> bool:
    """Whether stopped rows can leave this cache: every layer is a plain key/value layer (a hybrid model's
    linear-attention layers also hold conv and recurrent states that the cache's row selection leaves alone,
    so such a cache keeps its rows)."""
    layers = list(getattr(cache, "layers", None) or [])
    plain = _plain_layers()
    return callable(getattr(cache, "batch_select_indices", None)) and bool(layers) and bool(plain) \
        and all(type(layer) in plain for layer in layers)


def _returned_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.inference_mode()
def greedy_pruned(model: Any, encoded: list[list[int]], max_new_tokens: int, stops: list[int], pad: int,
                  device: torch.device | str) -> list[list[int]]:
    """Each prompt's greedy continuation (its stop token included when it stopped), at most `max_new_tokens`.

    Rows run together; a row that emits a stop token leaves the batch before the next step."""
    input_ids, mask = left_padded(encoded, pad)
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache, name = _returned_cache(out), _cache_name(model)
    token = out.logits[:, -1].argmax(-1)
    rows: list[list[int]] = [[] for _ in encoded]
    active = list(range(len(encoded)))            # the original row of each row still in the batch
    stopped = [False] * len(encoded)              # for a cache that cannot drop rows: they stay, unrecorded
    can_drop = can_drop_rows(cache)
    stop = torch.tensor(sorted(set(stops)) or [-1], device=token.device)
    for step in range(max_new_tokens):
        for row, value in zip(active, token.tolist(), strict=True):
            if not stopped[row]:
                rows[row].append(int(value))
        ended = torch.isin(token, stop)
        for row, flag in zip(active, ended.tolist(), strict=True):
            stopped[row] = stopped[row] or flag
        if step == max_new_tokens - 1 or all(stopped[row] for row in active):
            break
        if can_drop and bool(ended.any()):
            keep = (~ended).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            mask, token = mask[keep], token[keep]
            active = [active[i] for i in keep.tolist()]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                    use_cache=True, **{name: cache})
        cache = _returned_cache(out)
        token = out.logits[:, -1].argmax(-1)
    return rows
