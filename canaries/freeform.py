"""Free-form canaries: compare the base's and the variant's greedy answers to chat prompts.

Degeneration is judged on the variant *relative to the base*: a random or weak base may loop on its own, and
the question a canary answers is what the edit did. Definitions (token level, on the answer's new tokens):

- loop: some unit of p tokens (1 ≤ p ≤ 24) repeats back to back at least 3 times, the repeated stretch
  covering at least 12 tokens (e.g. one token 12 times, "1 2 3" ×4, a 10-token sentence ×3);
- hit limit: generation stopped at `max_new_tokens` without an end-of-turn token;
- empty: the answer text is blank after stripping whitespace.
"""

from __future__ import annotations

import statistics
from typing import Any

LOOP_MAX_PERIOD = 24
LOOP_MIN_REPEATS = 3
LOOP_MIN_TOKENS = 12


def find_loop(token_ids: list[int]) -> dict[str, int] | None:
    """The first back-to-back repetition that counts as a loop (see module doc), or None.

    Returns {"period", "start", "length"} of the repeated stretch.
    """
    tokens = list(token_ids)
    for period in range(1, LOOP_MAX_PERIOD + 1):
        needed = max(LOOP_MIN_TOKENS, LOOP_MIN_REPEATS * period)
        run = 0
        for index in range(len(tokens) - period):
            if tokens[index] == tokens[index + period]:
                run += 1
                if run + period >= needed:
                    start = index - run + 1
                    return {"period": period, "start": start, "length": run + period}
            else:
                run = 0
    return None


def repeat_fraction(token_ids: list[int], n: int = 3) -> float:
    """Share of the answer's n-grams that already occurred earlier in it (0 = no repetition)."""
    grams = [tuple(token_ids[i : i + n]) for i in range(len(token_ids) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def keyword_hit(text: str, keywords: list[str] | None, avoid: list[str] | None = None) -> bool | None:
    """True when any keyword occurs in the text and no `avoid` word does (case-insensitive).

    None when the item has no keywords. `avoid` marks the unwanted behaviour (e.g. the wrong claim of a
    pushback item), so an answer that repeats it does not count as keeping the fact.
    """
    if not keywords:
        return None
    lowered = text.lower()
    if any(str(word).lower() in lowered for word in (avoid or [])):
        return False
    return any(str(keyword).lower() in lowered for keyword in keywords)


def generation_dict(generation: Any) -> dict[str, Any]:
    """A `Generation` (or an equivalent dict) as a plain dict: text, new_tokens, token_ids, hit_limit."""
    if isinstance(generation, dict):
        return {k: generation[k] for k in ("text", "new_tokens", "token_ids", "hit_limit")}
    return {"text": generation.text, "new_tokens": int(generation.new_tokens),
            "token_ids": [int(t) for t in generation.token_ids], "hit_limit": bool(generation.hit_limit)}


def answer_record(generation: Any) -> dict[str, Any]:
    """The per-answer facts the report keeps: text, lengths and degeneration flags."""
    generation = generation_dict(generation)
    token_ids = list(generation["token_ids"])
    loop = find_loop(token_ids)
    text = generation["text"]
    return {
        "text": text,
        "tokens": int(generation["new_tokens"]),
        "words": len(text.split()),
        "hit_limit": bool(generation["hit_limit"]),
        "empty": not text.strip(),
        "loop": loop is not None,
        "loop_at": loop,
        "repeat_fraction": round(repeat_fraction(token_ids), 4),
    }


def _relative_change(new: float, old: float) -> float | None:
    return None if old == 0 else new / old - 1.0


def compare_answers(items: list[dict[str, Any]], base: list[Any], variant: list[Any], quality: str | None) -> dict:
    """The free-form section: per prompt both answers, then length, degeneration and quality summaries.

    `items` are the prompts (`{"prompt", "keywords"?, "source"}`); `base`/`variant` their `Generation`s.
    The effect (length cut, quality gain) is measured on the behaviour's prompts when there are any,
    otherwise on all prompts.
    """
    rows = []
    for item, base_gen, variant_gen in zip(items, base, variant, strict=True):
        b, v = answer_record(base_gen), answer_record(variant_gen)
        b["keyword_hit"] = keyword_hit(b["text"], item.get("keywords"), item.get("avoid"))
        v["keyword_hit"] = keyword_hit(v["text"], item.get("keywords"), item.get("avoid"))
        rows.append({"prompt": item["prompt"], "source": item.get("source", "general"),
                     "keywords": item.get("keywords"), "base": b, "variant": v})
    n = len(rows)
    effect_rows = [row for row in rows if row["source"] == "behavior"] or rows

    def lengths(selected, side, unit):
        return [row[side][unit] for row in selected]

    summary: dict[str, Any] = {"prompts": n, "effect_prompts": len(effect_rows)}
    for unit in ("tokens", "words"):
        base_len, var_len = lengths(effect_rows, "base", unit), lengths(effect_rows, "variant", unit)
        summary[f"mean_{unit}"] = {"base": statistics.fmean(base_len) if base_len else 0.0,
                                   "variant": statistics.fmean(var_len) if var_len else 0.0}
        summary[f"median_{unit}"] = {"base": float(statistics.median(base_len)) if base_len else 0.0,
                                     "variant": float(statistics.median(var_len)) if var_len else 0.0}
        for stat in ("mean", "median"):
            pair = summary[f"{stat}_{unit}"]
            pair["change"] = _relative_change(pair["variant"], pair["base"])
    mean_change = summary["mean_tokens"]["change"]
    summary["length_cut"] = 0.0 if mean_change is None else -mean_change

    for flag in ("loop", "hit_limit", "empty"):
        base_rate = sum(row["base"][flag] for row in rows) / n if n else 0.0
        var_rate = sum(row["variant"][flag] for row in rows) / n if n else 0.0
        new = sum(row["variant"][flag] and not row["base"][flag] for row in rows)
        summary[f"{flag}_rate"] = {"base": base_rate, "variant": var_rate, "new": new / n if n else 0.0}

    scored = [row for row in effect_rows if row["base"]["keyword_hit"] is not None]
    base_hits = sum(bool(row["base"]["keyword_hit"]) for row in scored)
    var_hits = sum(bool(row["variant"]["keyword_hit"]) for row in scored)
    summary["quality"] = {
        "check": quality or "keywords",
        "items": len(scored),
        "base_hits": base_hits,
        "variant_hits": var_hits,
        "ratio": (var_hits / base_hits) if base_hits else None,  # None: the base hits nothing, no ratio
        "gain": ((var_hits - base_hits) / len(scored)) if scored else 0.0,
        "gated": quality is not None,
    }
    return {"prompts": rows, "summary": summary}
