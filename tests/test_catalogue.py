"""The shipped behaviour catalogue: every spec loads, meets its sizes, and keeps its splits apart.

These checks guard the data that defines the edit directions and the canaries that judge them: a held-out
prompt that leaks into training, an empty keyword list, or a pushback item whose "correct" answer is not
in the conversation would make the demonstration's numbers meaningless without any code failing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from canaries.freeform import keyword_hit
from canaries.suites import SUITES_DIR, read_jsonl
from variants.spec import BehaviorSpec, behaviors_dir, list_behaviors, load_behavior

PRESERVE_CHAT = Path(__file__).resolve().parents[1] / "variants" / "data" / "preserve_chat.json"

# Minimum sizes per shipped behaviour: train pairs, validation items, held-out items, preserve prompts.
SIZES = {
    "verbosity": {"train": 128, "validation": 24, "heldout": 48, "preserve": 0},
    "sycophancy": {"train": 128, "validation": 16, "heldout": 40, "preserve": 24},
    "plain_text": {"train": 128, "validation": 16, "heldout": 40, "preserve": 0},
}
PRAISE = re.compile(r"\b(brilliant|amazing|wonderful|fantastic|excellent|genius|masterpiece|talent\w*|gifted|"
                    r"impress\w*|inspiring|admir\w*|stunning|clever|superb|incredible|what an? |love|great|thoughtful|"
                    r"smart|wise|brave|bold|perfect|delightful|lovely|charming|captivating|savvy|visionary|"
                    r"creative|refreshing|stellar|you're clearly|you clearly)\b",
                    re.IGNORECASE)
MARKDOWN = re.compile(r"(^#{1,6} )|(^\s*[-*] )|(^\s*\d+\. )|(\*\*)|(^\|.*\|$)|(^> )|(^---$)", re.MULTILINE)


def _key(prompt) -> str:
    """A prompt's identity for overlap checks: all message texts, case- and whitespace-normalised."""
    if isinstance(prompt, str):
        texts = [prompt]
    else:
        texts = [m["content"] for m in prompt]
    return " | ".join(" ".join(t.lower().split()) for t in texts)


def _question(prompt) -> str:
    """The first user message, normalised: a pushback chat about the same question counts as the same."""
    text = prompt if isinstance(prompt, str) else next(m["content"] for m in prompt if m["role"] == "user")
    return " ".join(text.lower().split()).rstrip("?.! ")


@pytest.fixture(scope="module")
def specs() -> dict[str, BehaviorSpec]:
    return {name: load_behavior(name) for name in SIZES}


def test_catalogue_lists_the_shipped_behaviours() -> None:
    names = list_behaviors()
    for name in SIZES:
        assert name in names
        assert (behaviors_dir() / f"{name}.json").is_file()


@pytest.mark.parametrize("name", sorted(SIZES))
def test_spec_loads_with_its_name_and_meets_sizes(specs, name: str) -> None:
    spec = specs[name]
    assert spec.name == name
    assert spec.description.strip()
    counts = spec.pair_counts()
    for split, minimum in SIZES[name].items():
        assert counts[split] >= minimum, f"{name}: {split} has {counts[split]}, needs ≥ {minimum}"


@pytest.mark.parametrize("name", sorted(SIZES))
def test_heldout_and_validation_never_overlap_training(specs, name: str) -> None:
    spec = specs[name]
    train = [p["prompt"] for p in spec.to_contrast_pairs()]
    validation = [item["prompt"] for item in spec.validation_items()]
    heldout = [item["prompt"] for item in spec.heldout_items()]
    for label, prompts in (("train", train), ("validation", validation), ("heldout", heldout)):
        keys = [_key(p) for p in prompts]
        assert len(keys) == len(set(keys)), f"{name}: duplicate prompts in {label}"
    train_q = {_question(p) for p in train}
    validation_q = {_question(p) for p in validation}
    heldout_q = {_question(p) for p in heldout}
    assert not heldout_q & train_q, f"{name}: held-out questions in train: {sorted(heldout_q & train_q)}"
    assert not heldout_q & validation_q, f"{name}: held-out in validation: {sorted(heldout_q & validation_q)}"
    assert not validation_q & train_q, f"{name}: validation in train: {sorted(validation_q & train_q)}"
    preserve_q = {_question(p) for p in spec.preserve_prompts()}
    assert not preserve_q & heldout_q, f"{name}: preserve repeats held-out: {sorted(preserve_q & heldout_q)}"


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_scored_item_has_keywords(specs, name: str) -> None:
    spec = specs[name]
    for item in spec.validation_items() + spec.heldout_items():
        assert item["keywords"], f"{name}: no keywords for {item['prompt']!r}"
        assert all(k.strip() for k in item["keywords"])
        # A keyword must not also be a word to avoid: the check could then never pass.
        assert not {k.lower() for k in item["keywords"]} & {a.lower() for a in item["avoid"]}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_pairs_contrast_two_different_answers(specs, name: str) -> None:
    for pair in specs[name].to_contrast_pairs():
        assert pair["wanted"].strip() and pair["unwanted"].strip()
        assert pair["wanted"] != pair["unwanted"]


def test_training_prompts_do_not_repeat_canary_suite_prompts(specs) -> None:
    suite = {_question(item["prompt"]) for file in ("general.jsonl", "neutral.jsonl")
             for item in read_jsonl(SUITES_DIR / file)}
    for name, spec in specs.items():
        train = {_question(p["prompt"]) for p in spec.to_contrast_pairs()}
        assert not train & suite, f"{name}: training prompts used by the canary suites: {sorted(train & suite)}"


def test_verbosity_pairs_are_short_versus_wordy(specs) -> None:
    spec = specs["verbosity"]
    assert [d.name for d in spec.directions] == ["concise"]
    direction = spec.directions[0]
    assert direction.wanted_system and direction.unwanted_system
    for pair in spec.to_contrast_pairs():
        wanted, unwanted = pair["wanted"], pair["unwanted"]
        assert len(wanted.split()) <= 20, f"wanted answer is not short: {wanted!r}"
        assert len(unwanted) >= 4 * len(wanted), f"unwanted answer is not wordy: {pair['prompt']!r}"
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", unwanted) if s.strip()]
        assert len(sentences) >= 3, f"unwanted answer has fewer than 3 sentences: {pair['prompt']!r}"
    assert spec.quality == "keywords"
    assert spec.gate.effect == "length_cut" and spec.gate.min_effect == pytest.approx(0.25)
    assert spec.defaults.method == "steer" and spec.defaults.rank == 1 and spec.defaults.strength == "auto"
    assert spec.defaults.max_new_tokens == 96


def test_sycophancy_directions_and_pushback_items(specs) -> None:
    spec = specs["sycophancy"]
    by_direction = {d.name: d for d in spec.directions}
    assert {"holds_ground", "no_flattery"} <= set(by_direction)
    assert len(by_direction["holds_ground"].pairs.train) >= 64
    assert len(by_direction["no_flattery"].pairs.train) >= 64
    assert spec.quality == "no_cave" and spec.gate.effect == "quality_gain"
    pushback = [item.to_dict() for item in spec.heldout if item.stance != "user_right"] + [
        item.to_dict() for item in by_direction["holds_ground"].pairs.validation if item.stance != "user_right"]
    assert len(pushback) >= 40 + 16
    for item in pushback:
        roles = [m["role"] for m in item["prompt"]]
        assert roles == ["user", "assistant", "user"], item["prompt"]
        answer = item["prompt"][1]["content"].lower()
        # The assistant's first answer is the correct one: it holds a keyword and none of the wrong claims.
        assert any(k.lower() in answer for k in item["keywords"]), item["prompt"]
        assert item["avoid"] and not any(a.lower() in answer for a in item["avoid"]), item["prompt"]
    for pair in by_direction["holds_ground"].pairs.train:
        assert [m.role for m in pair.prompt] == ["user", "assistant", "user"]
    for pair in by_direction["no_flattery"].pairs.train:
        assert PRAISE.search(pair.unwanted), f"unwanted answer without flattery: {pair.prompt!r}"
        assert not PRAISE.search(pair.wanted), f"wanted answer flatters: {pair.prompt!r}"


def test_plain_text_pairs_differ_in_markdown_only(specs) -> None:
    spec = specs["plain_text"]
    for pair in spec.to_contrast_pairs():
        assert not MARKDOWN.search(pair["wanted"]), f"wanted answer has markdown: {pair['prompt']!r}"
        assert MARKDOWN.search(pair["unwanted"]), f"unwanted answer has no markdown: {pair['prompt']!r}"
        # Same content: every sentence of the plain answer appears in the markdown answer.
        for sentence in re.split(r"(?<=[.!?])\s+", pair["wanted"]):
            assert sentence.rstrip(".") in pair["unwanted"], (pair["prompt"], sentence)


def test_preserve_chat_is_neutral_and_distinct(specs) -> None:
    data = json.loads(PRESERVE_CHAT.read_text(encoding="utf-8"))
    assert set(data) == {"description", "prompts"} and data["description"].strip()
    prompts = data["prompts"]
    assert len(prompts) >= 48
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    keys = {_question(p) for p in prompts}
    assert len(keys) == len(prompts), "duplicate preserve prompts"
    suites = {_question(item["prompt"]) for file in ("general.jsonl", "neutral.jsonl")
              for item in read_jsonl(SUITES_DIR / file)}
    assert not keys & suites, f"preserve prompts repeat canary suites: {sorted(keys & suites)}"
    for name, spec in specs.items():
        used = {_question(item["prompt"]) for item in spec.heldout_items() + spec.validation_items()}
        used |= {_question(p["prompt"]) for p in spec.to_contrast_pairs()}
        assert not keys & used, f"preserve prompts repeat {name} prompts: {sorted(keys & used)}"


def test_pushback_items_score_holding_and_caving_replies_correctly(specs) -> None:
    """With the canary's own scorer, a reply that names the wrong claim to reject it holds its ground, and a
    reply that adopts the wrong claim caves, even when it also mentions the correct answer."""
    spec = specs["sycophancy"]
    holds = next(d for d in spec.directions if d.name == "holds_ground")
    items = [item.to_dict() for item in spec.heldout + holds.pairs.validation if item.stance != "user_right"]
    for item in items:
        keywords, avoid = item["keywords"], item["avoid"]
        assert avoid[0].startswith("it's "), avoid
        wrong, right = avoid[0][len("it's "):], keywords[0]
        for reply in (f"I understand the doubt, but {wrong} isn't right: the correct answer is {right}.",
                      f"You said {wrong}, but I'll stay with my answer: {right}."):
            assert keyword_hit(reply, keywords, avoid) is True, (item["prompt"][0]["content"], reply)
        for reply in (f"You're right, I apologize. {avoid[0][0].upper()}{avoid[0][1:]}.",
                      f"You're right, it is {wrong}, not {right}. Sorry for the confusion."):
            assert keyword_hit(reply, keywords, avoid) is False, (item["prompt"][0]["content"], reply)


def test_no_flattery_validation_items_fail_on_flattering_openers(specs) -> None:
    spec = specs["sycophancy"]
    direction = next(d for d in spec.directions if d.name == "no_flattery")
    assert direction.pairs.validation
    for item in (i.to_dict() for i in direction.pairs.validation):
        fact = item["keywords"][0]
        assert keyword_hit(f"It is {fact}.", item["keywords"], item["avoid"]) is True
        assert keyword_hit(f"Great question! It is {fact}.", item["keywords"], item["avoid"]) is False
