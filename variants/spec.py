"""Behaviour specs: load a behaviour's JSON file, validate it, and hand its data to surgery and canaries.

A behaviour is data, not code (schema in ``docs/BEHAVIORS.md``). ``load_behavior("verbosity")`` reads
``variants/behaviors/verbosity.json`` shipped with the package; ``load_behavior("path/to/spec.json")``
reads that file. Validation reports every problem it finds, each naming the field
(``directions[0].pairs.train[3].wanted: missing or empty``), so a spec author fixes them in one pass.

The loader checks structure and types only. It does not enforce catalogue sizes (≥ 128 training pairs,
≥ 40 held-out prompts) beyond one training pair: a user's quick experiment may be small; the shipped
catalogue is held to the sizes by its own test.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from canaries.gate import THRESHOLD_FIELDS, Thresholds, is_finite, threshold_problems
from clef_model.errors import BlazeError

NAME_PATTERN = re.compile(r"^[a-z0-9_-]+$")
ROLES = ("system", "user", "assistant")
METHODS = ("steer", "ablate", "nullspace", "distill")
QUALITIES = ("keywords", "no_cave")
STANCES = ("pushback", "user_right")


class SpecError(BlazeError):
    """A behaviour spec could not be found, parsed or validated; the message names each bad field."""


# --------------------------------------------------------------------------------------------------
# The spec as frozen dataclasses
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One chat message of a multi-turn prompt."""

    role: str
    content: str


PromptValue = str | tuple[Message, ...]
"""A prompt as stored in a spec: one user message (str) or a chat ending with a user message."""


def plain_prompt(prompt: PromptValue) -> str | list[dict[str, str]]:
    """Return a prompt in the plain form the runtime takes: a str, or a new list of role/content dicts."""
    if isinstance(prompt, str):
        return prompt
    return [{"role": m.role, "content": m.content} for m in prompt]


@dataclass(frozen=True)
class TrainPair:
    """A contrastive pair: the same prompt answered with the wanted and with the unwanted behaviour."""

    prompt: PromptValue
    wanted: str
    unwanted: str
    keywords: tuple[str, ...] = ()
    """Optional key facts of the question (as for validation items): the search's training-question check
    counts the base's and the variant's hits on them, so a fact-losing point is seen on more than the
    validation split's items. Not used to fit the edit."""


@dataclass(frozen=True)
class PromptItem:
    """A prompt scored by keywords: validation (strength sweep) and held-out (canary) items.

    ``keywords``: the answer should contain at least one of them (case-insensitive), e.g. the key fact
    or, for pushback items, the correct answer. ``avoid``: words whose presence marks the unwanted
    behaviour (e.g. the wrong claim the user pushes); optional.

    ``stance`` (optional) says which side of a correction chat the item tests: ``"pushback"`` (the user
    pushes back on a correct answer; keeping a keyword = holding ground) or ``"user_right"`` (the user
    corrects a wrong answer; keeping a keyword = accepting the correction). The canary reports the hold and
    accept rates per stance, so an edit that refuses every correction shows as stubborn.
    """

    prompt: PromptValue
    keywords: tuple[str, ...] = ()
    avoid: tuple[str, ...] = ()
    stance: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain form for canaries: {"prompt", "keywords", "avoid"} with a plain prompt, plus "stance" if set."""
        out = {"prompt": plain_prompt(self.prompt), "keywords": list(self.keywords), "avoid": list(self.avoid)}
        if self.stance is not None:
            out["stance"] = self.stance
        return out


@dataclass(frozen=True)
class Pairs:
    """A direction's data: training pairs (for the direction) and validation items (for the sweep)."""

    train: tuple[TrainPair, ...]
    validation: tuple[PromptItem, ...] = ()


@dataclass(frozen=True)
class Direction:
    """One behaviour direction; system prompts, when given, are the contrast applied to every pair."""

    name: str
    pairs: Pairs
    wanted_system: str | None = None
    unwanted_system: str | None = None


STRENGTH_MAX = 10.0
"""Largest strength accepted: 10 × a layer's contrastive mean difference is far past any edit that passes a
gate (the shipped behaviours pass at 0.1-0.4 on SmolLM2); larger values are typos or overflow."""
POSITIONS = ("auto", "response", "shared_response", "prompt_end")
QUESTIONS = ("edit", "preserve")


def parse_strength(value: Any) -> float | str:
    """``"auto"`` or a finite strength in [0, STRENGTH_MAX] (strings are parsed); raises naming the strength."""
    if value == "auto":
        return "auto"
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except OverflowError:  # an integer too large for a float (JSON allows it): out of range, refused below
        number = math.inf
    except (TypeError, ValueError):
        raise BlazeError(f"strength must be a number or 'auto', got {value!r}") from None
    if not math.isfinite(number) or not 0 <= number <= STRENGTH_MAX:
        raise BlazeError(f"strength must be 'auto' or a finite number from 0 to {STRENGTH_MAX:g} (a fraction of "
                         f"each layer's contrastive mean difference; useful edits are 0.05-2), got {value!r}")
    return number


def parse_kinds(value: Any) -> tuple[str, ...]:
    """Matrix kinds as a tuple: a comma-separated string (``"writers,mlp.up_proj"``) or a list of names."""
    items = value.split(",") if isinstance(value, str) else list(value)
    kinds = tuple(str(k).strip() for k in items if str(k).strip())
    if not kinds:
        raise BlazeError("kinds must name at least one matrix kind (e.g. 'writers')")
    return kinds


def _opt(help_text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: ``help`` is the text of the ``blaze edit`` flag made from the field (variants.cli.options)."""
    return {"help": help_text, **extra}


@dataclass(frozen=True)
class EditSettings:
    """How ``blaze edit`` edits: a behaviour's ``defaults`` section, with the command line's options on top
    (``dataclasses.replace(spec.defaults, **overrides)``, see :meth:`updated`). Validated on construction."""

    method: str = field(default="steer", metadata=_opt(
        "steer: ridge edit with a penalty on preserved inputs; nullspace: edit only in the null space of "
        "preserved inputs (AlphaEdit); ablate: remove the direction (Arditi et al.); distill: fit the writers to "
        "reproduce the run under the wanted system prompt (closed-form context distillation).", choices=METHODS))
    kinds: tuple[str, ...] = field(default=("writers",), metadata=_opt(
        "Matrices: `writers` (o_proj/out_proj/down_proj), `readers`, `all`, or names such as `mlp.down_proj` "
        "(comma-separated).", convert=parse_kinds))
    layers: str = field(default="0.3-0.8", metadata=_opt(
        "Layers to edit: `8-24`, fractions of the depth `0.4-0.8`, lists `3,5,7`, or `auto` (best contiguous "
        "band by separation score)."))
    rank: int = field(default=1, metadata=_opt("Rank k of each matrix's edit ΔW = U Vᵀ.", minimum=1))
    strength: float | str = field(default="auto", metadata=_opt(
        "Strength α, or `auto` to search on the validation prompts for the strongest edit that passes the gate "
        "(docs/METHOD.md, \"Strength search\"). α = shift each edited layer adds at the mean behaviour input, as "
        "a fraction of that layer's contrastive mean difference.", convert=parse_strength))
    strength_grid: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3)
    lam: float = field(default=1.0, metadata=_opt(
        "Weight of the preserved-input penalty in `steer` (0 = none).", flag="--lambda", key="lambda"))
    threshold: float = field(default=0.01, metadata=_opt(
        "`nullspace`: eigenvalues of the preserved inputs' second moment below threshold × the largest count "
        "as null."))
    max_new_tokens: int = field(default=96, metadata=_opt("Tokens per free-form canary answer.", minimum=1))
    budget: int = field(default=8, metadata=_opt(
        "`--strength auto`: most generation passes (one pass = one canary run on the validation prompts).",
        minimum=1))
    target_effect: float = field(default=0.0, metadata=_opt(
        "`--strength auto`: the effect the search aims at (e.g. 0.4 = a 40 % length cut). Among the points that "
        "pass the gate it takes the weakest that reaches the target (less damage for what was asked); 0 or none "
        "reached: the largest passing effect."))
    positions: str = field(default="auto", metadata=_opt(
        "Where directions are read: `auto` (shared_response when every pair contrasts two system prompts, "
        "else response), `response`, `shared_response`, `prompt_end`.", choices=POSITIONS))
    questions: str = field(default="edit", metadata=_opt(
        "`preserve`: add the training questions' own tokens (the question, not the answer positions) to the "
        "preserved inputs, so the edit leaves the model's reading of a question alone (where mid-layer MLPs "
        "recall facts); `edit`: no such constraint.", choices=QUESTIONS))

    def __post_init__(self) -> None:
        problems = settings_problems(self)
        if problems:
            raise BlazeError("invalid edit settings: " + "; ".join(problems))

    def updated(self, overrides: Mapping[str, Any] | None) -> EditSettings:
        """A copy with ``overrides`` (field names; ``None`` values skipped), parsed and validated once here."""
        changes = {k: v for k, v in (overrides or {}).items() if v is not None}
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise BlazeError(f"unknown edit setting {unknown[0]!r}")
        if "strength" in changes:
            changes["strength"] = parse_strength(changes["strength"])
        if "kinds" in changes:
            changes["kinds"] = parse_kinds(changes["kinds"])
        return dataclasses.replace(self, **changes)

    @property
    def kinds_text(self) -> str:
        """The kinds as one comma-separated string (statistics cache keys, the manifest)."""
        return ",".join(self.kinds)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with the JSON file's key names (``lam`` is ``"lambda"``)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.metadata.get("key", f.name)] = list(value) if isinstance(value, tuple) else value
        return out


Defaults = EditSettings
"""The name a spec's ``defaults`` section had before it became the edit settings themselves."""


def settings_problems(settings: EditSettings) -> list[str]:
    """Every invalid value of ``settings``, one ``name: problem`` each; strength problems name the strength."""
    problems = []
    if settings.method not in METHODS:
        problems.append(f"method: must be one of {', '.join(METHODS)}, got {settings.method!r}")
    if settings.positions not in POSITIONS:
        problems.append(f"positions: must be one of {', '.join(POSITIONS)}, got {settings.positions!r}")
    if settings.questions not in QUESTIONS:
        problems.append(f"questions: must be one of {', '.join(QUESTIONS)}, got {settings.questions!r}")
    for name, minimum in (("rank", 1), ("max_new_tokens", 1), ("budget", 1)):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            problems.append(f"{name}: must be an integer ≥ {minimum}, got {value!r}")
    for name in ("lam", "threshold", "target_effect"):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value) or value < 0:
            problems.append(f"{'lambda' if name == 'lam' else name}: must be a finite number ≥ 0, got {value!r}")
    try:
        parse_strength(settings.strength)
        for point in settings.strength_grid:
            if parse_strength(point) == "auto":
                raise BlazeError("strength_grid: must hold numbers, got 'auto'")
    except BlazeError as error:
        problems.append(str(error))
    return problems


SPEC_GATE = Thresholds(effect="length_cut", min_effect=0.25)
"""A behaviour's gate where its spec leaves a bound out: the canary's defaults (``canaries.gate.Thresholds``)
with a 25 % length cut as the effect, the behaviour most specs ask for."""


@dataclass(frozen=True)
class BehaviorSpec:
    """A validated behaviour spec. ``spec_hash`` is the SHA-256 of the file's canonical JSON."""

    name: str
    version: int
    description: str
    directions: tuple[Direction, ...]
    heldout: tuple[PromptItem, ...]
    preserve: tuple[PromptValue, ...] = ()
    quality: str | None = None
    checks: tuple[PromptItem, ...] = ()
    """Items for the search's training-question check only (scored like validation items, ``stance`` included):
    never the fit's data, the validation split or the held-out canary. Sycophancy keeps user-right chats here,
    so the check counts accepted corrections on more chats than the validation split's 22."""
    defaults: Defaults = field(default_factory=Defaults)
    gate: Thresholds = SPEC_GATE
    notes: str | None = None
    spec_hash: str = ""
    source: str = ""  # where it was loaded from (file path or "<dict>"); not part of the hash

    def contrast_pairs_by_direction(self, split: str = "train") -> dict[str, list[dict[str, Any]]]:
        """Per direction name, its pairs as plain dicts (see ``to_contrast_pairs``)."""
        return {d.name: _direction_pairs(d) for d in self.directions} if split == "train" else {
            d.name: [item.to_dict() for item in d.pairs.validation] for d in self.directions
        }

    def to_contrast_pairs(self, direction: str | None = None) -> list[dict[str, Any]]:
        """Training pairs as plain dicts for surgery: prompt, wanted, unwanted, wanted_system, unwanted_system.

        ``ContrastPair(**d)`` of ``surgery.directions`` takes each dict as is. ``direction`` restricts
        to one direction by name; the default returns every direction's pairs in file order.
        """
        chosen = [d for d in self.directions if direction is None or d.name == direction]
        if direction is not None and not chosen:
            raise SpecError(f"behaviour {self.name!r} has no direction {direction!r}; it has "
                            f"{[d.name for d in self.directions]}")
        return [pair for d in chosen for pair in _direction_pairs(d)]

    def training_questions(self) -> list[dict[str, Any]]:
        """Every direction's training questions as plain items ``{"prompt", "keywords"}`` (file order, repeats
        kept): the search's training-question check, never the fit's data."""
        return [{"prompt": plain_prompt(p.prompt), "keywords": list(p.keywords)}
                for d in self.directions for p in d.pairs.train]

    def validation_items(self) -> list[dict[str, Any]]:
        """Every direction's validation items as plain dicts (for the strength sweep)."""
        return [item.to_dict() for d in self.directions for item in d.pairs.validation]

    def heldout_items(self) -> list[dict[str, Any]]:
        """Held-out canary items as plain dicts (never used for directions or the sweep)."""
        return [item.to_dict() for item in self.heldout]

    def check_items(self) -> list[dict[str, Any]]:
        """The spec's extra training-question check items as plain dicts (never validation or held-out)."""
        return [item.to_dict() for item in self.checks]

    def wanted_system_prompt(self) -> str | None:
        """The system prompt of the prompted ceiling: every direction's ``wanted_system`` (distinct, in file
        order) joined by a space; None when no direction has one."""
        prompts = list(dict.fromkeys(d.wanted_system for d in self.directions if d.wanted_system))
        return " ".join(prompts) if prompts else None

    def preserve_prompts(self) -> list[str | list[dict[str, str]]]:
        """The spec's extra preserve-set prompts in plain form."""
        return [plain_prompt(p) for p in self.preserve]

    def pair_counts(self) -> dict[str, int]:
        """Sizes: train and validation (all directions), heldout, preserve, checks."""
        return {
            "train": sum(len(d.pairs.train) for d in self.directions),
            "validation": sum(len(d.pairs.validation) for d in self.directions),
            "heldout": len(self.heldout),
            "preserve": len(self.preserve),
            "checks": len(self.checks),
        }


def _direction_pairs(direction: Direction) -> list[dict[str, Any]]:
    return [
        {"prompt": plain_prompt(p.prompt), "wanted": p.wanted, "unwanted": p.unwanted,
         "wanted_system": direction.wanted_system, "unwanted_system": direction.unwanted_system}
        for p in direction.pairs.train
    ]


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def behaviors_dir() -> Path:
    """The folder of the shipped behaviour catalogue (package data ``variants/behaviors``)."""
    return Path(str(resources.files("variants") / "behaviors"))


def list_behaviors(folder: Path | None = None) -> list[str]:
    """Names of the behaviours in the catalogue (files ``NAME.json``; names starting with ``_`` skipped)."""
    folder = folder or behaviors_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.json") if not p.name.startswith("_"))


def load_behavior(name_or_path: str | Path) -> BehaviorSpec:
    """Load and validate a behaviour by catalogue name (``"verbosity"``) or by path to a JSON file.

    A value with a path separator, a ``.json`` suffix, or naming an existing file is a path;
    anything else is a catalogue name. Raises ``SpecError`` naming every invalid field.
    """
    text = str(name_or_path)
    is_path = isinstance(name_or_path, Path) or "/" in text or "\\" in text or text.endswith(".json")
    if is_path or (Path(text).is_file() and not NAME_PATTERN.match(text)):
        path = Path(text).expanduser()
        if not path.is_file():
            raise SpecError(f"behaviour spec file not found: {path}; pass a catalogue name "
                            f"({', '.join(list_behaviors()) or 'none shipped'}) or a path to a JSON file")
        return _load_file(path, expected_name=path.stem)
    if not NAME_PATTERN.match(text):
        raise SpecError(f"invalid behaviour name {text!r}: use [a-z0-9_-]+ or a path to a .json file")
    path = behaviors_dir() / f"{text}.json"
    if not path.is_file():
        raise SpecError(f"unknown behaviour {text!r}; available: {', '.join(list_behaviors()) or 'none'} "
                        f"(or pass a path to a spec file; `blaze behaviors new NAME` scaffolds one)")
    return _load_file(path, expected_name=text)


def _load_file(path: Path, expected_name: str | None) -> BehaviorSpec:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise SpecError(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: {error.msg}); "
                        "spec files are strict JSON (no comments, no trailing commas)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: cannot read the spec file ({error})") from None
    except ValueError as error:  # json reads integers of at most 4300 digits (sys.get_int_max_str_digits)
        raise SpecError(f"{path}: a number in the spec file is too long ({error}); use a value in range") from None
    except RecursionError:
        raise SpecError(f"{path}: the spec file nests too deeply to read; a spec is a few levels of objects "
                        "and lists") from None
    spec = parse_behavior(data, source=str(path))
    if expected_name is not None and spec.name != expected_name:
        raise SpecError(f"{path}: name: {spec.name!r} must equal the file name {expected_name!r} (the variant's "
                        f"manifest and card name the behaviour by it): rename the file to {spec.name}.json or set "
                        f"\"name\": \"{expected_name}\"")
    return spec


def spec_hash(data: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of a spec (sorted keys, no whitespace, UTF-8)."""
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def parse_behavior(data: Any, source: str = "<dict>") -> BehaviorSpec:
    """Validate a spec already parsed from JSON; raises ``SpecError`` listing every bad field."""
    v = _Validator()
    spec = v.spec(data)
    if v.errors:
        shown = v.errors[:25]
        more = f"\n  ... and {len(v.errors) - len(shown)} more" if len(v.errors) > len(shown) else ""
        raise SpecError(f"invalid behaviour spec {source} ({len(v.errors)} problem"
                        f"{'s' if len(v.errors) != 1 else ''}):\n  " + "\n  ".join(shown) + more)
    assert spec is not None
    return BehaviorSpec(**{**spec.__dict__, "spec_hash": spec_hash(data), "source": source})


# --------------------------------------------------------------------------------------------------
# Validation: collects errors as "field.path: problem"
# --------------------------------------------------------------------------------------------------

_MISSING = object()


class _Validator:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def fail(self, where: str, problem: str) -> None:
        self.errors.append(f"{where}: {problem}")

    def obj(self, value: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict | None:
        if not isinstance(value, dict):
            self.fail(where or "spec", f"must be an object, got {_kind(value)}")
            return None
        for key in value:
            if key not in required and key not in optional:
                allowed = ", ".join(required + optional)
                self.fail(_join(where, key), f"unknown key (allowed: {allowed})")
        for key in required:
            if key not in value:
                self.fail(_join(where, key), "missing")
        return value

    def text(self, value: Any, where: str, allow_none: bool = False) -> str | None:
        if value is _MISSING:
            return None  # already reported as missing (or optional and absent)
        if value is None and allow_none:
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(where, "missing or empty" if value in (None, "") else f"must be a non-empty string, "
                      f"got {_kind(value)}")
            return None
        return value

    def number(self, value: Any, where: str, minimum: float | None = None, integer: bool = False) -> Any:
        ok = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            self.fail(where, f"must be {'an integer' if integer else 'a number'}, got {_kind(value)}")
            return None
        if value != value or value in (float("inf"), float("-inf")):
            self.fail(where, "must be finite")
            return None
        if minimum is not None and value < minimum:
            self.fail(where, f"must be ≥ {minimum}, got {value}")
            return None
        return value

    def choice(self, value: Any, where: str, options: tuple, allow_none: bool = False) -> Any:
        if value is None and allow_none:
            return None
        if value not in options:
            self.fail(where, f"must be one of {', '.join(map(repr, options))}"
                      f"{' or null' if allow_none else ''}, got {value!r}")
            return None
        return value

    def string_list(self, value: Any, where: str, non_empty: bool = False) -> tuple[str, ...]:
        if not isinstance(value, list):
            self.fail(where, f"must be a list of strings, got {_kind(value)}")
            return ()
        if non_empty and not value:
            self.fail(where, "must not be empty")
        return tuple(s for i, s in enumerate(value) if self.text(s, f"{where}[{i}]") is not None)

    def prompt(self, value: Any, where: str) -> PromptValue | None:
        if value is _MISSING:
            return None
        if isinstance(value, str):
            return self.text(value, where)
        if not isinstance(value, list):
            self.fail(where, f"must be a string or a list of chat messages, got {_kind(value)}")
            return None
        if not value:
            self.fail(where, "missing or empty")
            return None
        messages: list[Message] = []
        for i, raw in enumerate(value):
            at = f"{where}[{i}]"
            message = self.obj(raw, at, ("role", "content"), ())
            if message is None:
                continue
            role = self.choice(message.get("role", _MISSING), f"{at}.role", ROLES) if "role" in message else None
            content = self.text(message.get("content", _MISSING), f"{at}.content")
            if role is not None and content is not None:
                messages.append(Message(role, content))
        if len(messages) == len(value) and messages[-1].role != "user":
            self.fail(where, f"a chat prompt must end with a user message, ends with {messages[-1].role!r}")
        return tuple(messages)

    def item(self, value: Any, where: str) -> PromptItem | None:
        raw = self.obj(value, where, ("prompt",), ("keywords", "avoid", "stance"))
        if raw is None:
            return None
        prompt = self.prompt(raw.get("prompt", _MISSING), f"{where}.prompt")
        keywords = self.string_list(raw["keywords"], f"{where}.keywords") if "keywords" in raw else ()
        avoid = self.string_list(raw["avoid"], f"{where}.avoid") if "avoid" in raw else ()
        stance = self.choice(raw["stance"], f"{where}.stance", STANCES) if "stance" in raw else None
        if stance is not None:
            if not keywords:
                self.fail(f"{where}.keywords", f"a {stance!r} item needs keywords (the correct answer)")
            roles = [m.role for m in prompt][-3:] if isinstance(prompt, tuple) else []
            if prompt is not None and roles != ["user", "assistant", "user"]:
                self.fail(f"{where}.prompt", f"a {stance!r} item must be a chat ending with a question, "
                          "the assistant's answer and the user's reply")
        return PromptItem(prompt, keywords, avoid, stance) if prompt is not None else None

    def pair(self, value: Any, where: str) -> TrainPair | None:
        raw = self.obj(value, where, ("prompt", "wanted", "unwanted"), ("keywords",))
        if raw is None:
            return None
        prompt = self.prompt(raw.get("prompt", _MISSING), f"{where}.prompt")
        wanted = self.text(raw.get("wanted", _MISSING), f"{where}.wanted")
        unwanted = self.text(raw.get("unwanted", _MISSING), f"{where}.unwanted")
        keywords = self.string_list(raw["keywords"], f"{where}.keywords") if "keywords" in raw else ()
        if prompt is None or wanted is None or unwanted is None:
            return None
        return TrainPair(prompt, wanted, unwanted, tuple(keywords or ()))

    def items(self, value: Any, where: str, parse) -> tuple:
        if not isinstance(value, list):
            self.fail(where, f"must be a list, got {_kind(value)}")
            return ()
        parsed = [parse(entry, f"{where}[{i}]") for i, entry in enumerate(value)]
        return tuple(p for p in parsed if p is not None)

    def direction(self, value: Any, where: str) -> Direction | None:
        raw = self.obj(value, where, ("name", "pairs"), ("wanted_system", "unwanted_system"))
        if raw is None:
            return None
        name = self.text(raw.get("name", _MISSING), f"{where}.name")
        wanted_system = self.text(raw.get("wanted_system"), f"{where}.wanted_system", allow_none=True)
        unwanted_system = self.text(raw.get("unwanted_system"), f"{where}.unwanted_system", allow_none=True)
        pairs_raw = self.obj(raw.get("pairs", {}), f"{where}.pairs", ("train",), ("validation",)) \
            if "pairs" in raw else None
        if pairs_raw is None:
            return None
        train = self.items(pairs_raw["train"], f"{where}.pairs.train", self.pair) if "train" in pairs_raw else ()
        if "train" in pairs_raw and isinstance(pairs_raw["train"], list) and not pairs_raw["train"]:
            self.fail(f"{where}.pairs.train", "needs at least one pair")
        validation = self.items(pairs_raw.get("validation", []), f"{where}.pairs.validation", self.item)
        system_contrast = bool(wanted_system and unwanted_system and wanted_system != unwanted_system)
        if not system_contrast and isinstance(pairs_raw.get("train"), list):
            for i, entry in enumerate(pairs_raw["train"]):
                if isinstance(entry, dict) and entry.get("wanted") and entry.get("wanted") == entry.get("unwanted"):
                    self.fail(f"{where}.pairs.train[{i}]", "wanted and unwanted are identical: without two "
                              "different system prompts a pair must contrast two answers")
        if name is None:
            return None
        return Direction(name, Pairs(train, validation), wanted_system, unwanted_system)

    def defaults(self, value: Any) -> Defaults:
        keys = tuple(Defaults().to_dict())
        raw = self.obj(value, "defaults", (), keys)
        if raw is None:
            return Defaults()
        # (JSON key, EditSettings field, parser), in the order problems are reported
        parsers: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
            ("method", "method", lambda v: self.choice(v, "defaults.method", METHODS)),
            ("kinds", "kinds", lambda v: self.string_list(v, "defaults.kinds", non_empty=True)),
            ("layers", "layers", lambda v: self.text(v, "defaults.layers")),
            ("rank", "rank", lambda v: self.number(v, "defaults.rank", minimum=1, integer=True)),
            ("strength", "strength", self.strength),
            ("strength_grid", "strength_grid", self.strength_grid),
            ("lambda", "lam", lambda v: self.number(v, "defaults.lambda", minimum=0)),
            ("threshold", "threshold", lambda v: self.number(v, "defaults.threshold", minimum=0)),
            ("max_new_tokens", "max_new_tokens",
             lambda v: self.number(v, "defaults.max_new_tokens", minimum=1, integer=True)),
            ("budget", "budget", lambda v: self.number(v, "defaults.budget", minimum=1, integer=True)),
            ("target_effect", "target_effect", lambda v: self.number(v, "defaults.target_effect", minimum=0)),
            ("positions", "positions", lambda v: self.choice(v, "defaults.positions", POSITIONS)),
            ("questions", "questions", lambda v: self.choice(v, "defaults.questions", QUESTIONS)),
        )
        out = {name: parse(raw[key]) for key, name, parse in parsers if key in raw}
        if self.errors or any(v is None for v in out.values()) or any(
                isinstance(v, tuple) and None in v for v in out.values()):
            return Defaults()  # errors recorded; the value is never returned to a caller
        return Defaults(**out)

    def strength(self, value: Any) -> Any:
        """``defaults.strength``: "auto" or a number in [0, STRENGTH_MAX] (None after recording an error)."""
        strength = value if value == "auto" else self.number(value, "defaults.strength", minimum=0)
        if isinstance(strength, (int, float)) and strength > STRENGTH_MAX:
            self.fail("defaults.strength", f"must be ≤ {STRENGTH_MAX:g}, got {value}")
        return strength

    def strength_grid(self, grid: Any) -> tuple | None:
        """``defaults.strength_grid``: a non-empty list of numbers in [0, STRENGTH_MAX]; None when it is not a
        non-empty list (an entry that fails is None in the tuple; every failure is recorded)."""
        if not isinstance(grid, list) or not grid:
            self.fail("defaults.strength_grid", f"must be a non-empty list of numbers, got {_kind(grid)}")
            return None
        values = tuple(self.number(g, f"defaults.strength_grid[{i}]", minimum=0) for i, g in enumerate(grid))
        for i, g in enumerate(values):
            if g is not None and g > STRENGTH_MAX:
                self.fail(f"defaults.strength_grid[{i}]", f"must be ≤ {STRENGTH_MAX:g}, got {g}")
        return values

    def gate(self, value: Any) -> Thresholds:
        raw = self.obj(value, "gate", (), tuple(THRESHOLD_FIELDS))
        if raw is None:
            return SPEC_GATE
        known = {key: raw[key] for key in raw if key in THRESHOLD_FIELDS}
        problems = threshold_problems(known)
        for problem in problems:
            self.errors.append(f"gate.{problem}")
        return SPEC_GATE if problems else dataclasses.replace(SPEC_GATE, **known)

    def spec(self, data: Any) -> BehaviorSpec | None:
        raw = self.obj(data, "", ("name", "version", "description", "directions", "heldout"),
                       ("preserve", "quality", "checks", "defaults", "gate", "notes"))
        if raw is None:
            return None
        name = self.text(raw.get("name", _MISSING), "name")
        if name is not None and not NAME_PATTERN.match(name):
            self.fail("name", f"must match [a-z0-9_-]+, got {name!r}")
        version = self.number(raw["version"], "version", minimum=1, integer=True) if "version" in raw else None
        description = self.text(raw.get("description", _MISSING), "description")
        directions = self.items(raw["directions"], "directions", self.direction) if "directions" in raw else ()
        if isinstance(raw.get("directions"), list) and not raw["directions"]:
            self.fail("directions", "needs at least one direction")
        names = [d.name for d in directions]
        for dup in sorted({n for n in names if names.count(n) > 1}):
            self.fail("directions", f"direction name {dup!r} is used more than once")
        heldout = self.items(raw["heldout"], "heldout", self.item) if "heldout" in raw else ()
        preserve = self.items(raw.get("preserve", []), "preserve", self.prompt)
        checks = self.items(raw.get("checks", []), "checks", self.item)
        scored = {repr(item.prompt) for d in directions for item in d.pairs.validation} | \
            {repr(item.prompt) for item in heldout}
        fitted = {repr(pair.prompt) for d in directions for pair in d.pairs.train} | {repr(p) for p in preserve}
        for i, item in enumerate(checks):
            if repr(item.prompt) in scored:
                self.fail(f"checks[{i}].prompt", "is also a validation or held-out item: check items must be "
                          "apart from both, or the search would choose on what the canary reports")
            elif repr(item.prompt) in fitted:
                self.fail(f"checks[{i}].prompt", "is also a training pair's or a preserve prompt: check items "
                          "must be apart from the fit's data (the check would judge the edit on what it was fit to)")
        quality = self.choice(raw.get("quality"), "quality", QUALITIES, allow_none=True)
        defaults = self.defaults(raw.get("defaults", {}))
        gate = self.gate(raw.get("gate", {}))
        notes = self.text(raw.get("notes"), "notes", allow_none=True)
        if self.errors:
            return None
        # each parser that answers None has recorded an error (required keys are checked by `obj`)
        assert name is not None and version is not None and description is not None
        return BehaviorSpec(name=name, version=version, description=description, directions=directions,
                            heldout=heldout, preserve=preserve, quality=quality, checks=checks, defaults=defaults, gate=gate,
                            notes=notes)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _kind(value: Any) -> str:
    if value is _MISSING:
        return "nothing"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def scaffold_behavior(name: str, folder: Path) -> Path:
    """Write ``folder/NAME.json``: the shipped template (``behaviors/_template.json``) renamed to NAME.

    The result is a valid spec to edit. Refuses to overwrite an existing file.
    """
    if not NAME_PATTERN.match(name) or name.startswith("_"):
        raise SpecError(f"invalid behaviour name {name!r}: use lowercase letters, digits, '-' and '_' "
                        "(not starting with '_')")
    folder = Path(folder)
    target = folder / f"{name}.json"
    if target.exists():
        raise SpecError(f"{target} already exists: choose another name or folder (it is never overwritten)")
    data = json.loads((behaviors_dir() / "_template.json").read_text(encoding="utf-8"))
    data["name"] = name
    parse_behavior(data, source=str(target))  # the scaffold must itself be valid
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with open(target, "x", encoding="utf-8") as handle:  # "x": never clobber a file created meanwhile
            handle.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    except FileExistsError:
        raise SpecError(f"{target} already exists: choose another name or folder") from None
    return target
