"""The free-form noise floor: how much the *base's* answers move by numerics alone, reported beside the edit.

The free-form verdicts turn on single answers (a new loop, a lost key fact). In bfloat16 a greedy answer near
a tie or near a repetition can change with no edit at all when only the batch around it changes: on one H200,
SmolLM2's answers to 160 questions differed in 19 places and looped once more with nothing changed but the
decode (BENCHMARKS, "One H200, round 5"). So the canary can rerun the base once more through a second numeric
path, one prompt per batch (no padding, other kernel shapes) in its own dtype, and count what moved: answers
whose tokens differ, loops and limit runs that appear or disappear, key-fact hits that flip. A reader then sees
whether "2 new loops" is more than the base does to itself. The gate is not changed by it: the floor is
evidence, not an excuse. (The decision canaries have the same idea: `canaries.decision_eval.noise_floor`.)
It costs one more pass of the base over the free-form prompts, unbatched, so it is opt-in (`--noise-floor`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

NOISE_BATCH = 1
"""The second path's batch: one prompt per forward pass (no padding)."""


@dataclass(frozen=True)
class FreeformNoise:
    """What moved between the base's answers in the canary's batches and the same answers one prompt per batch."""

    path: str
    items: int
    answers_differ: int
    loops_new: int
    loops_gone: int
    limit_new: int
    limit_gone: int
    keyword_flips: int

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the report (`freeform.noise_floor`)."""
        return asdict(self)


def noise_path(batch_size: int) -> str:
    """The second numeric path, in words."""
    return f"one prompt per batch against batches of {batch_size}"


def summarize_noise(items: list[dict[str, Any]], reference: list[Any], again: list[Any], path: str) -> FreeformNoise:
    """Count what moved between two runs of the same model over ``items`` (``reference``: the canary's base
    answers; ``again``: the second path's)."""
    from canaries.freeform import generation_dict, score_answer

    counts = dict.fromkeys(("answers_differ", "loops_new", "loops_gone", "limit_new", "limit_gone",
                            "keyword_flips"), 0)
    for item, first, second in zip(items, reference, again, strict=True):
        a, b = score_answer(item, first), score_answer(item, second)
        counts["answers_differ"] += generation_dict(first)["token_ids"] != generation_dict(second)["token_ids"]
        counts["loops_new"] += b["loop"] and not a["loop"]
        counts["loops_gone"] += a["loop"] and not b["loop"]
        counts["limit_new"] += b["hit_limit"] and not a["hit_limit"]
        counts["limit_gone"] += a["hit_limit"] and not b["hit_limit"]
        counts["keyword_flips"] += a["keyword_hit"] is not None and a["keyword_hit"] != b["keyword_hit"]
    return FreeformNoise(path=path, items=len(items), **counts)


def noise_line(noise: dict[str, Any], new_loops: int) -> str:
    """One sentence for the terminal and Markdown reports: the base's own movement beside the edit's new loops."""
    return (f"Noise floor (the base, {noise['path']}): {noise['answers_differ']} of {noise['items']} answers differ, "
            f"loops {noise['loops_new']} new / {noise['loops_gone']} gone, limit runs {noise['limit_new']} new / "
            f"{noise['limit_gone']} gone, {noise['keyword_flips']} key-fact hits flip. The edit: {new_loops} new "
            f"loop{'s' if new_loops != 1 else ''}.")
