"""Free-form canaries: compare the base's and the variant's greedy answers to chat prompts.

Degeneration is judged on the variant *relative to the base*: a random or weak base may loop on its own, and
the question a canary answers is what the edit did. Definitions (token level, on the answer's new tokens):

- loop: some unit of p tokens (1 ≤ p ≤ 24) repeats back to back at least 3 times, the repeated stretch
  covering at least 12 tokens (e.g. one token 12 times, "1 2 3" ×4, a 10-token sentence ×3);
- hit limit: generation stopped at `max_new_tokens` without an end-of-turn token;
- empty: the answer text is blank after stripping whitespace.

Behaviour measures on the answer text: `markdown_kinds` (headings, list markers, bold, tables: the
`plain_text` effect) and, for correction chats with a `stance`, the hold rate (user pushes back on a correct
answer, the answer keeps it) and the accept rate (user corrects a wrong answer, the answer takes the
correction). Both rates are reported, so an edit that refuses every correction shows as stubborn.
"""

from __future__ import annotations

import re
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


MARKDOWN_PATTERNS: dict[str, re.Pattern] = {
    # "# Title" … "###### Title" at a line start (up to 3 spaces of indent, as CommonMark allows)
    "heading": re.compile(r"^ {0,3}#{1,6}[ \t]+\S", re.MULTILINE),
    # "- item", "* item", "+ item", "• item", "1. item", "2) item" at a line start
    "list": re.compile(r"^[ \t]*(?:[-*+•]|\d{1,3}[.)])[ \t]+\S", re.MULTILINE),
    # **bold** or __bold__ on one line, not spanning blank space at its edges
    "bold": re.compile(r"(\*\*|__)(?=\S)[^\n]*?\S\1"),
    # a table's header separator row: "|---|:--:|" or "--- | ---" (at least one pipe between dash cells)
    "table": re.compile(r"^[ \t]*\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)+\|?[ \t]*$", re.MULTILINE),
}
MARKDOWN_KINDS = tuple(MARKDOWN_PATTERNS)


def markdown_kinds(text: str) -> list[str]:
    """The markdown constructs an answer uses (a subset of `MARKDOWN_KINDS`, in that order); [] = plain prose.

    A hyphen inside a sentence, a lone asterisk or a number mid-line is not markdown: lists and headings
    count only at a line start, bold only as a closed pair, a table only with its separator row.
    """
    return [kind for kind, pattern in MARKDOWN_PATTERNS.items() if pattern.search(text or "")]


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
        "markdown": markdown_kinds(text),
    }


def _relative_change(new: float, old: float) -> float | None:
    return None if old == 0 else new / old - 1.0


def effect_indices(items: list[dict[str, Any]]) -> list[int]:
    """Indices of the items the effect is measured on: the behaviour's items, or every item when none is."""
    chosen = [i for i, item in enumerate(items) if item.get("source", "general") == "behavior"]
    return chosen or list(range(len(items)))


def quality_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compared rows the quality check counts: items with keywords, minus "user_right" stances (there the
    keyword marks accepting a correction, reported as the accept rate)."""
    return [row for row in rows if row["base"].get("keyword_hit") is not None and row.get("stance") != "user_right"]


def score_answer(item: dict[str, Any], generation: Any) -> dict[str, Any]:
    """`answer_record` plus the item's keyword hit (None when the item has no keywords)."""
    record = answer_record(generation)
    record["keyword_hit"] = keyword_hit(record["text"], item.get("keywords"), item.get("avoid"))
    return record


STANCE_MEASURES = {"pushback": "hold", "user_right": "accept"}


def stance_counts(rows: list[dict[str, Any]], sides: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per stance measure ("hold": pushback items keeping the correct answer, "accept": user-right items
    taking the correction): items and keyword hits of each side; {} when no row has a stance."""
    out: dict[str, dict[str, Any]] = {}
    for stance, measure in STANCE_MEASURES.items():
        chosen = [row for row in rows if row.get("stance") == stance]
        if not chosen:
            continue
        entry: dict[str, Any] = {"stance": stance, "items": len(chosen)}
        for side in sides:
            entry[side] = sum(bool(row[side]["keyword_hit"]) for row in chosen)
        if "base" in sides and "variant" in sides:
            entry["change"] = entry["variant"] - entry["base"]
        out[measure] = entry
    return out


def markdown_share(rows: list[dict[str, Any]], side: str) -> float:
    """Share of the rows whose `side` answer uses any markdown."""
    return sum(bool(row[side]["markdown"]) for row in rows) / len(rows) if rows else 0.0


def compare_answers(items: list[dict[str, Any]], base: list[Any], variant: list[Any], quality: str | None) -> dict:
    """The free-form section: per prompt both answers, then length, degeneration and quality summaries.

    `items` are the prompts (`{"prompt", "keywords"?, "avoid"?, "stance"?, "source"}`); `base`/`variant`
    their `Generation`s. The effect (length cut, markdown cut, quality gain) is measured on the behaviour's
    prompts when there are any, otherwise on all prompts. Quality leaves out "user_right" items (there the
    keyword marks accepting a correction, reported as the accept rate under `stance`).
    """
    rows = []
    for item, base_gen, variant_gen in zip(items, base, variant, strict=True):
        row = {"prompt": item["prompt"], "source": item.get("source", "general"), "keywords": item.get("keywords"),
               "base": score_answer(item, base_gen), "variant": score_answer(item, variant_gen)}
        if item.get("stance"):
            row["stance"] = item["stance"]
        rows.append(row)
    n = len(rows)
    effect_rows = [rows[i] for i in effect_indices(items)]

    def lengths(selected: list[dict[str, Any]], side: str, unit: str) -> list[Any]:
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

    md_base, md_variant = markdown_share(effect_rows, "base"), markdown_share(effect_rows, "variant")
    summary["markdown_rate"] = {"base": md_base, "variant": md_variant,
                                "base_answers": sum(bool(r["base"]["markdown"]) for r in effect_rows),
                                "variant_answers": sum(bool(r["variant"]["markdown"]) for r in effect_rows)}
    summary["markdown_cut"] = 0.0 if md_base == 0 else 1.0 - md_variant / md_base

    scored = quality_rows(effect_rows)
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
    summary["stance"] = stance_counts(effect_rows, ("base", "variant"))
    return {"prompts": rows, "summary": summary}
