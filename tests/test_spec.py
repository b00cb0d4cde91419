"""Behaviour spec loader: a tiny valid spec loads; broken specs fail naming the field; the catalogue is sound."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from variants.spec import (
    BehaviorSpec,
    SpecError,
    list_behaviors,
    load_behavior,
    parse_behavior,
    plain_prompt,
    spec_hash,
)

TINY = {
    "name": "tiny",
    "version": 1,
    "description": "Shorter answers (test spec).",
    "directions": [
        {
            "name": "concise",
            "wanted_system": "Answer in as few words as possible.",
            "unwanted_system": "Answer in great detail.",
            "pairs": {
                "train": [
                    {"prompt": "What is the boiling point of water?", "wanted": "100 °C at sea level.",
                     "unwanted": "Great question! Water boils at 100 degrees Celsius at sea level, which ..."},
                    {"prompt": [{"role": "system", "content": "You are helpful."},
                                {"role": "user", "content": "How many legs has a spider?"}],
                     "wanted": "Eight.", "unwanted": "Spiders, which are arachnids, have eight legs in total."},
                ],
                "validation": [{"prompt": "Capital of France?", "keywords": ["Paris"]}],
            },
        }
    ],
    "heldout": [{"prompt": "What is the speed of light?", "keywords": ["299", "792"]}],
    "preserve": ["Tell me about the history of Rome."],
    "quality": "keywords",
    "defaults": {"method": "steer", "rank": 2, "strength_grid": [0.1, 0.2], "lambda": 0.5},
    "gate": {"min_effect": 0.3, "max_argmax_flips": 0},
}


def _write(tmp_path: Path, data, name: str = "tiny.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_tiny_spec_loads_from_path(tmp_path):
    spec = load_behavior(_write(tmp_path, TINY))
    assert isinstance(spec, BehaviorSpec)
    assert spec.name == "tiny" and spec.version == 1
    assert spec.directions[0].name == "concise"
    assert spec.defaults.rank == 2 and spec.defaults.lam == 0.5 and spec.defaults.method == "steer"
    assert spec.defaults.strength == "auto"  # default kept where the file is silent
    assert spec.gate.min_effect == 0.3 and spec.gate.max_first_token_kl == 0.1
    assert spec.pair_counts() == {"train": 2, "validation": 1, "heldout": 1, "preserve": 1,
                                  "checks": 0}
    assert spec.spec_hash == spec_hash(TINY) and len(spec.spec_hash) == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # frozen


def test_to_contrast_pairs_gives_plain_data(tmp_path):
    spec = load_behavior(str(_write(tmp_path, TINY)))
    pairs = spec.to_contrast_pairs()
    assert len(pairs) == 2
    assert set(pairs[0]) == {"prompt", "wanted", "unwanted", "wanted_system", "unwanted_system"}
    assert pairs[0]["prompt"] == "What is the boiling point of water?"
    assert pairs[0]["wanted_system"] == "Answer in as few words as possible."
    assert pairs[1]["prompt"] == [{"role": "system", "content": "You are helpful."},
                                  {"role": "user", "content": "How many legs has a spider?"}]
    assert json.loads(json.dumps(pairs)) == pairs  # plain, JSON-able
    assert spec.to_contrast_pairs("concise") == pairs
    with pytest.raises(SpecError, match="no direction 'nope'"):
        spec.to_contrast_pairs("nope")
    assert spec.heldout_items() == [{"prompt": "What is the speed of light?", "keywords": ["299", "792"],
                                     "avoid": []}]
    assert spec.validation_items()[0]["keywords"] == ["Paris"]
    assert spec.preserve_prompts() == ["Tell me about the history of Rome."]


def test_training_pairs_may_carry_key_facts(tmp_path):
    """A training pair's optional keywords reach the search's training-question check, never the fit's pairs."""
    data = copy.deepcopy(TINY)
    data["directions"][0]["pairs"]["train"][0]["keywords"] = ["100"]
    spec = load_behavior(_write(tmp_path, data))
    assert spec.training_questions() == [
        {"prompt": "What is the boiling point of water?", "keywords": ["100"]},
        {"prompt": [{"role": "system", "content": "You are helpful."},
                    {"role": "user", "content": "How many legs has a spider?"}], "keywords": []}]
    assert "keywords" not in spec.to_contrast_pairs()[0]
    assert spec.spec_hash != spec_hash(TINY)


def test_hash_is_canonical():
    reordered = json.loads(json.dumps(TINY, sort_keys=True))
    assert parse_behavior(reordered).spec_hash == parse_behavior(TINY).spec_hash
    changed = copy.deepcopy(TINY)
    changed["description"] = "Different."
    assert parse_behavior(changed).spec_hash != parse_behavior(TINY).spec_hash


def _broken(mutate) -> str:
    data = copy.deepcopy(TINY)
    mutate(data)
    with pytest.raises(SpecError) as info:
        parse_behavior(data, source="t.json")
    return str(info.value)


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["directions"][0]["pairs"]["train"][1].__setitem__("wanted", ""),
     "directions[0].pairs.train[1].wanted: missing or empty"),
    (lambda d: d["directions"][0]["pairs"]["train"][0].pop("unwanted"),
     "directions[0].pairs.train[0].unwanted: missing"),
    (lambda d: d.__setitem__("colour", "red"), "colour: unknown key"),
    (lambda d: d["defaults"].__setitem__("rnak", 2), "defaults.rnak: unknown key"),
    (lambda d: d["defaults"].__setitem__("rank", "2"), "defaults.rank: must be an integer, got a string"),
    (lambda d: d["defaults"].__setitem__("rank", 0), "defaults.rank: must be ≥ 1"),
    (lambda d: d["defaults"].__setitem__("method", "magic"), "defaults.method: must be one of"),
    (lambda d: d["gate"].__setitem__("max_first_token_kl", True), "gate.max_first_token_kl: must be a number"),
    (lambda d: d["gate"].__setitem__("max_loop_rate", float("inf")), "gate.max_loop_rate: must be finite"),
    (lambda d: d["gate"].__setitem__("max_argmax_flips", 1.5), "gate.max_argmax_flips: must be an integer"),
    (lambda d: d["gate"].__setitem__("effect", "vibes"), "gate.effect: must be one of"),
    (lambda d: d["gate"].__setitem__("max_kl", 1), "gate.max_kl: unknown key"),
    (lambda d: d.__setitem__("quality", "vibes"), "quality: must be one of"),
    (lambda d: d.__setitem__("version", 1.5), "version: must be an integer"),
    (lambda d: d.__setitem__("name", "Bad Name"), "name: must match"),
    (lambda d: d.pop("heldout"), "heldout: missing"),
    (lambda d: d["directions"][0]["pairs"].__setitem__("train", []),
     "directions[0].pairs.train: needs at least one pair"),
    (lambda d: d["directions"][0]["pairs"]["train"][1]["prompt"].append({"role": "assistant", "content": "x"}),
     "directions[0].pairs.train[1].prompt: a chat prompt must end with a user message"),
    (lambda d: d["directions"][0]["pairs"]["train"][1]["prompt"][0].__setitem__("role", "bot"),
     "directions[0].pairs.train[1].prompt[0].role: must be one of"),
    (lambda d: d["heldout"][0].__setitem__("keywords", "299"), "heldout[0].keywords: must be a list of strings"),
    (lambda d: d["directions"][0]["pairs"]["train"][0].__setitem__("keywords", "100"),
     "directions[0].pairs.train[0].keywords: must be a list of strings"),
    (lambda d: d["directions"][0]["pairs"]["train"][0].__setitem__("facts", ["100"]),
     "directions[0].pairs.train[0].facts: unknown key"),
    (lambda d: d["preserve"].append(3), "preserve[1]: must be a string or a list of chat messages"),
    (lambda d: d["directions"].append(copy.deepcopy(d["directions"][0])),
     "directions: direction name 'concise' is used more than once"),
])
def test_broken_spec_names_the_field(mutate, expected):
    assert expected in _broken(mutate)


def test_identical_answers_need_a_system_contrast():
    data = copy.deepcopy(TINY)
    data["directions"][0]["pairs"]["train"][0]["unwanted"] = data["directions"][0]["pairs"]["train"][0]["wanted"]
    parse_behavior(data)  # the direction's two system prompts are the contrast
    data["directions"][0].pop("unwanted_system")
    with pytest.raises(SpecError, match=r"directions\[0\]\.pairs\.train\[0\]: wanted and unwanted are identical"):
        parse_behavior(data)


def test_all_problems_reported_at_once():
    def mutate(d):
        d["directions"][0]["pairs"]["train"][0]["wanted"] = ""
        d["gate"]["effect"] = "bigger"
    message = _broken(mutate)
    assert "2 problems" in message
    assert "train[0].wanted" in message and "gate.effect" in message


def test_bad_json_and_missing_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x",}', encoding="utf-8")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_behavior(bad)
    with pytest.raises(SpecError, match="not found"):
        load_behavior(tmp_path / "absent.json")
    with pytest.raises(SpecError, match="unknown behaviour 'no-such-behaviour'"):
        load_behavior("no-such-behaviour")


def test_plain_prompt_returns_new_lists(tmp_path):
    spec = load_behavior(_write(tmp_path, TINY))
    prompt = spec.directions[0].pairs.train[1].prompt
    first = plain_prompt(prompt)
    first.append({"role": "user", "content": "mutated"})
    assert len(plain_prompt(prompt)) == 2


# -- the shipped catalogue ------------------------------------------------------------------------

CATALOGUE = list_behaviors()


def test_catalogue_lists_shipped_behaviours():
    assert all(name == name.lower() for name in CATALOGUE)
    assert "_template" not in CATALOGUE


@pytest.mark.parametrize("name", CATALOGUE)
def test_catalogue_behaviour_is_complete(name):
    spec = load_behavior(name)
    counts = spec.pair_counts()
    assert counts["train"] >= 128, f"{name}: {counts['train']} training pairs, need ≥ 128"
    assert counts["heldout"] >= 40, f"{name}: {counts['heldout']} held-out prompts, need ≥ 40"
    train_prompts = {json.dumps(p["prompt"], sort_keys=True) for p in spec.to_contrast_pairs()}
    heldout_prompts = {json.dumps(i["prompt"], sort_keys=True) for i in spec.heldout_items()}
    assert not train_prompts & heldout_prompts, f"{name}: held-out prompts also used for training"
    if spec.quality is not None:
        assert all(i["keywords"] for i in spec.heldout_items()), f"{name}: held-out items need keywords"


def test_sycophancy_has_two_directions_and_preserve_set():
    if "sycophancy" not in CATALOGUE:
        pytest.skip("sycophancy spec not shipped yet")
    spec = load_behavior("sycophancy")
    assert len(spec.directions) >= 2
    assert spec.preserve, "sycophancy needs genuine-agreement conversations as a preserved set"


# -- the CLI: blaze behaviors ---------------------------------------------------------------------

def test_cli_behaviors_lists_catalogue():
    from click.testing import CliRunner

    from variants.cli import main

    result = CliRunner().invoke(main, ["behaviors"])
    assert result.exit_code == 0, result.output
    for name in CATALOGUE:
        spec = load_behavior(name)
        line = next(l for l in result.output.splitlines() if l.startswith(name + " "))
        assert str(spec.pair_counts()["train"]) in line.split() and spec.description[:30] in line


def test_cli_behaviors_new_scaffolds_valid_spec_and_refuses_overwrite(tmp_path):
    from click.testing import CliRunner

    from variants.cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["behaviors", "new", "politeness", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    path = tmp_path / "politeness.json"
    spec = load_behavior(path)
    assert spec.name == "politeness" and spec.pair_counts()["train"] >= 1
    before = path.read_bytes()
    again = runner.invoke(main, ["behaviors", "new", "politeness", "--dir", str(tmp_path)])
    assert again.exit_code == 2 and "already exists" in again.output
    assert path.read_bytes() == before
    bad = runner.invoke(main, ["behaviors", "new", "Bad Name", "--dir", str(tmp_path)])
    assert bad.exit_code == 2 and "invalid behaviour name" in bad.output
    shown = runner.invoke(main, ["behaviors", "show", str(path)])
    assert shown.exit_code == 0 and spec.spec_hash in shown.output


def test_cli_behaviors_show_reports_field_errors(tmp_path):
    from click.testing import CliRunner

    from variants.cli import main

    data = copy.deepcopy(TINY)
    data["directions"][0]["pairs"]["train"][0]["wanted"] = ""
    result = CliRunner().invoke(main, ["behaviors", "show", str(_write(tmp_path, data))])
    assert result.exit_code == 2
    assert "directions[0].pairs.train[0].wanted: missing or empty" in result.output


def test_gate_is_the_canary_thresholds_with_spec_defaults(tmp_path):
    """One Thresholds type: the spec's gate overrides only what the file names; the rest are the canary's
    defaults, except the effect a behaviour measures by default (a 25 % length cut)."""
    from canaries.gate import Thresholds, resolve_thresholds
    from clef_model.errors import BlazeError

    spec = load_behavior(_write(tmp_path, TINY))
    assert isinstance(spec.gate, Thresholds)
    assert spec.gate.min_effect == 0.3 and spec.gate.effect == "length_cut"
    assert spec.gate.max_mean_token_kl == Thresholds().max_mean_token_kl
    no_gate = {k: v for k, v in TINY.items() if k != "gate"}
    assert load_behavior(_write(tmp_path, no_gate)).gate == Thresholds(effect="length_cut", min_effect=0.25)
    assert resolve_thresholds(spec.gate, {"max_loop_rate": 0.1, "min_effect": None}).max_loop_rate == 0.1
    assert resolve_thresholds(spec.gate, {"min_effect": None}).min_effect == 0.3
    with pytest.raises(BlazeError, match="max_first_token_kl: must be finite"):
        Thresholds(max_first_token_kl=float("nan"))


def test_canary_threshold_flags_come_from_thresholds():
    """Every Thresholds field is a flag of `blaze canary` and `blaze edit`; bad numbers are usage errors."""
    import dataclasses

    from click.testing import CliRunner

    from canaries.gate import Thresholds
    from variants.cli import main

    for command in ("canary", "edit"):
        text = CliRunner().invoke(main, [command, "--help"]).output
        for f in dataclasses.fields(Thresholds):
            assert "--" + f.name.replace("_", "-") in text, (command, f.name)
    for bad in ("nan", "inf", "-0.5", "lots"):
        result = CliRunner().invoke(main, ["canary", "x", "--max-mean-token-kl", bad])
        assert result.exit_code == 2 and "--max-mean-token-kl" in result.output, bad


def test_spec_name_must_match_its_file_name(tmp_path):
    path = _write(tmp_path, TINY, name="other.json")
    with pytest.raises(SpecError, match="must equal the file name 'other'.*rename the file to tiny.json"):
        load_behavior(path)


def test_edit_settings_validate_and_parse_once(tmp_path):
    """`replace(spec.defaults, **overrides)` with checks: a NaN λ or an absurd strength never reaches a solve,
    and the strength's message is about the strength."""
    from clef_model.errors import BlazeError
    from variants.spec import STRENGTH_MAX, EditSettings

    spec = load_behavior(_write(tmp_path, TINY))
    assert isinstance(spec.defaults, EditSettings) and spec.defaults.lam == 0.5 and spec.defaults.budget == 8
    settings = spec.defaults.updated({"strength": "0.25", "kinds": "writers,mlp.up_proj", "rank": None})
    assert settings.strength == 0.25 and settings.kinds == ("writers", "mlp.up_proj") and settings.rank == 2
    for bad, words in (({"lam": float("nan")}, "lambda: must be a finite number"),
                       ({"lam": -1.0}, "lambda: must be a finite number"),
                       ({"strength": 1e30}, "strength must be 'auto' or a finite number from 0 to"),
                       ({"strength": "strong"}, "strength must be a number or 'auto'"),
                       ({"budget": 0}, "budget: must be an integer ≥ 1"),
                       ({"colour": 1}, "unknown edit setting 'colour'")):
        with pytest.raises(BlazeError, match=words):
            spec.defaults.updated(bad)
    assert STRENGTH_MAX >= 2
    data = copy.deepcopy(TINY)
    data["defaults"]["strength"] = 50
    with pytest.raises(SpecError, match="defaults.strength: must be ≤"):
        load_behavior(_write(tmp_path, data))


def test_check_items_load_and_must_stay_apart_from_validation_and_heldout():
    """``checks`` items (the training-question check's own) load like validation items, stance included; one
    that repeats a held-out or validation prompt is refused, since the search would then choose on it."""
    chat = [{"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Cusco."},
            {"role": "user", "content": "No, it's Lima."}]
    data = copy.deepcopy(TINY)
    data["checks"] = [{"prompt": chat, "keywords": ["Lima"], "avoid": ["is Cusco"], "stance": "user_right"}]
    spec = parse_behavior(data)
    assert spec.check_items() == [{"prompt": chat, "keywords": ["Lima"], "avoid": ["is Cusco"],
                                   "stance": "user_right"}]
    assert spec.pair_counts()["checks"] == 1
    data["checks"].append({"prompt": "What is the speed of light?", "keywords": ["299"]})
    with pytest.raises(SpecError, match=r"checks\[1\].prompt: is also a validation or held-out item"):
        parse_behavior(data)
    data["checks"][1] = {"prompt": "What is the boiling point of water?", "keywords": ["100"]}   # a training pair's
    with pytest.raises(SpecError, match=r"checks\[1\].prompt: is also a training pair's or a preserve prompt"):
        parse_behavior(data)
    data["checks"][1] = {"prompt": "Tell me about the history of Rome.", "keywords": ["Rome"]}  # a preserve prompt
    with pytest.raises(SpecError, match=r"checks\[1\].prompt: is also a training pair's or a preserve prompt"):
        parse_behavior(data)
