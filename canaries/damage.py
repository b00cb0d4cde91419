"""Damage figures: how far the variant's next-token distributions moved from the base's on neutral input.

- first-token KL(base ‖ variant) at the generation prompt of each neutral chat prompt;
- mean per-token KL(base ‖ variant) over the base's own greedy continuation, teacher-forced through both;
- perplexity of both models on neutral paragraphs.

Memory: vocabularies are large (248k at 9B), so full-vocab tensors never live for both models at once on the
device. The base pass (`reference_pass`) keeps its log-probabilities at the few scored positions on the CPU
(float32 while small, float16 beyond `_FP32_LIMIT` elements); the variant pass (`compare_pass`) moves one
batch of them back at a time and reduces it to per-position KL before the next batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

_FP32_LIMIT = 64 * 1024 * 1024  # stored base log-prob elements above which they are kept in float16


def _batches(count: int, size: int) -> Iterator[range]:
    for start in range(0, count, size):
        yield range(start, min(start + size, count))


@torch.inference_mode()
def scored_log_probs(runtime: Any, sequences: list[list[int]], positions: list[list[int]], batch_size: int,
                     consume: Callable[[int, torch.Tensor], None]) -> None:
    """Run right-padded batches through the runtime's CausalLM and call `consume(i, logp)` per sequence.

    `logp` holds float32 log-softmax rows (len(positions[i]) × vocab) at the requested positions of
    sequence i, on the runtime's device. Right padding keeps each real token's causal context intact.
    """
    model = runtime.model
    device = runtime.device
    pad_id = runtime.tokenizer.pad_token_id
    if pad_id is None:
        pad_id = runtime.tokenizer.eos_token_id or 0
    for batch in _batches(len(sequences), max(1, batch_size)):
        width = max(len(sequences[i]) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i], dtype=torch.long)
            mask[row, : len(sequences[i])] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        for row, i in enumerate(batch):
            rows = logits[row, torch.tensor(positions[i], device=logits.device)]
            consume(i, torch.log_softmax(rows.float(), dim=-1))
        del logits


def _continuation_tokens(generation: Any, limit: int) -> list[int]:
    return list(generation.token_ids)[:limit]


def _text_sequences(runtime: Any, texts: list[str]) -> list[list[int]]:
    sequences = []
    for text in texts:
        ids = list(runtime.tokenizer(text, add_special_tokens=True)["input_ids"])
        if len(ids) < 2:
            ids = list(runtime.tokenizer(" " + text, add_special_tokens=True)["input_ids"])
        sequences.append(ids)
    return sequences


def _nll_consumer(sequences: list[list[int]], out: list[float]) -> Callable[[int, torch.Tensor], None]:
    def consume(i: int, logp: torch.Tensor) -> None:
        targets = torch.tensor(sequences[i][1:], device=logp.device)
        out[i] = float(-logp.gather(1, targets[:, None]).sum())
    return consume


def reference_pass(runtime: Any, prompts: list[Any], texts: list[str], *, damage_tokens: int,
                   batch_size: int) -> dict[str, Any]:
    """The base side: greedy continuations of the neutral prompts, log-probs at their positions, text NLLs.

    Runs under whatever weights are active on `runtime` (call it inside the base view's `activate()`).
    """
    prompt_ids = [list(runtime.chat_ids(prompt)) for prompt in prompts]
    generations = runtime.generate(list(prompts), max_new_tokens=damage_tokens, batch_size=batch_size)
    continuations = [_continuation_tokens(g, damage_tokens) for g in generations]
    sequences = [ids + cont for ids, cont in zip(prompt_ids, continuations, strict=True)]
    positions = [list(range(len(ids) - 1, len(ids) - 1 + max(1, len(cont))))
                 for ids, cont in zip(prompt_ids, continuations, strict=True)]
    vocab_rows = sum(len(p) for p in positions)
    log_probs: list[torch.Tensor | None] = [None] * len(sequences)

    def keep(i: int, logp: torch.Tensor) -> None:
        store_dtype = torch.float32 if vocab_rows * logp.shape[-1] <= _FP32_LIMIT else torch.float16
        log_probs[i] = logp.to(device="cpu", dtype=store_dtype)

    scored_log_probs(runtime, sequences, positions, batch_size, keep)
    text_seqs = _text_sequences(runtime, texts)
    nll = [0.0] * len(text_seqs)
    scored_log_probs(runtime, text_seqs, [list(range(len(s) - 1)) for s in text_seqs], batch_size,
                     _nll_consumer(text_seqs, nll))
    return {"sequences": sequences, "positions": positions, "log_probs": log_probs,
            "continuations": [g.text for g in generations],
            "text_sequences": text_seqs, "text_nll": nll}


def compare_pass(runtime: Any, reference: dict[str, Any], *, batch_size: int) -> dict[str, Any]:
    """The variant side: KL(base ‖ variant) per scored position of the base's sequences, and text NLLs.

    Runs under the variant's weights (call it inside the variant view's `activate()`).
    """
    kl: list[list[float]] = [[] for _ in reference["sequences"]]

    def compare(i: int, logp_variant: torch.Tensor) -> None:
        logp_base = reference["log_probs"][i].to(device=logp_variant.device, dtype=torch.float32)
        per_position = (logp_base.exp() * (logp_base - logp_variant)).sum(-1).clamp_min(0.0)
        kl[i] = [float(x) for x in per_position.cpu()]

    scored_log_probs(runtime, reference["sequences"], reference["positions"], batch_size, compare)
    text_seqs = reference["text_sequences"]
    nll = [0.0] * len(text_seqs)
    scored_log_probs(runtime, text_seqs, [list(range(len(s) - 1)) for s in text_seqs], batch_size,
                     _nll_consumer(text_seqs, nll))
    return {"kl": kl, "text_nll": nll}


def summarize(prompts: list[Any], reference: dict[str, Any], compared: dict[str, Any]) -> dict[str, Any]:
    """The damage section of the report."""
    rows = []
    for prompt, kl, continuation in zip(prompts, compared["kl"], reference["continuations"], strict=True):
        rows.append({"prompt": prompt, "first_token_kl": kl[0], "mean_token_kl": sum(kl) / len(kl),
                     "max_token_kl": max(kl), "positions": len(kl), "base_continuation": continuation})
    all_kl = [value for kl in compared["kl"] for value in kl]
    tokens = sum(len(s) - 1 for s in reference["text_sequences"])
    base_nll, var_nll = sum(reference["text_nll"]), sum(compared["text_nll"])
    texts = [{"tokens": len(s) - 1, "perplexity_base": math.exp(b / max(1, len(s) - 1)),
              "perplexity_variant": math.exp(v / max(1, len(s) - 1))}
             for s, b, v in zip(reference["text_sequences"], reference["text_nll"], compared["text_nll"], strict=True)]
    ppl_base = math.exp(base_nll / tokens) if tokens else float("nan")
    ppl_var = math.exp(var_nll / tokens) if tokens else float("nan")
    return {
        "prompts": rows,
        "texts": texts,
        "summary": {
            "first_token_kl": {"mean": sum(r["first_token_kl"] for r in rows) / len(rows) if rows else 0.0,
                               "max": max((r["first_token_kl"] for r in rows), default=0.0)},
            "mean_token_kl": sum(all_kl) / len(all_kl) if all_kl else 0.0,
            "max_token_kl": max(all_kl, default=0.0),
            "scored_positions": len(all_kl),
            "perplexity": {"base": ppl_base, "variant": ppl_var,
                           "change": (ppl_var / ppl_base - 1.0) if tokens else None},
            "text_tokens": tokens,
        },
    }
