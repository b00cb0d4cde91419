"""Canary suites: data files beside this module, and the loaders that turn them into plain lists.

Suites are data (JSONL, one item a line) so they can be read and changed without touching code:

- `general.jsonl`       free-form chat prompts (`{"prompt", "keywords"?}`), first "What is the speed of light?"
- `neutral.jsonl`       neutral chat prompts for the damage figures (first-token and per-token KL)
- `neutral_texts.jsonl` neutral paragraphs (`{"text"}`) for perplexity
- `decisions.jsonl`     SystemOne requests (`{"id", "model", "state", "questions", "labels"?, "image"?}`);
                        the first is the model card's invoice request. `"image": "receipt"` asks the loader
                        to attach an image drawn in code (no binary files in the repo).
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

from clef_model.errors import BlazeError

SUITES_DIR = Path(__file__).resolve().parent

# Keys of a SystemOne request body that the release's `systemone`/`encode_record` read; everything else in a
# suite item (labels, image names) is canary metadata and is stripped before the request reaches a model.
REQUEST_KEYS = ("model", "state", "questions", "images", "videos", "id")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read a JSONL file (blank lines and lines starting with `#` skipped); errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise BlazeError(f"suite file not found: {path}; pass an existing JSONL file")
    items: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise BlazeError(f"{path}:{number}: not valid JSON ({error.msg}); each line must be one JSON object") from None
        if not isinstance(item, dict):
            raise BlazeError(f"{path}:{number}: expected a JSON object, got {type(item).__name__}")
        items.append(item)
    if not items:
        raise BlazeError(f"{path}: the suite is empty; add at least one JSON object line")
    return items


def general_prompts() -> list[dict[str, Any]]:
    """The general free-form suite: `{"prompt", "keywords"}` items, first "What is the speed of light?"."""
    return [dict(item) for item in read_jsonl(SUITES_DIR / "general.jsonl")]


def neutral_prompts() -> list[dict[str, Any]]:
    """Neutral chat prompts (`{"prompt"}`) for first-token and per-token KL."""
    return [dict(item) for item in read_jsonl(SUITES_DIR / "neutral.jsonl")]


def neutral_texts() -> list[str]:
    """Neutral paragraphs for perplexity."""
    return [item["text"] for item in read_jsonl(SUITES_DIR / "neutral_texts.jsonl")]


def receipt_image() -> Image.Image:
    """A shop receipt drawn with PIL (food items, total 62.40): the image canary needs no binary file."""
    from PIL import Image, ImageDraw

    lines = [
        "GREEN MARKET",
        "12 Harbour St",
        "----------------------",
        "Bread          3.20",
        "Cheese        11.90",
        "Apples         4.30",
        "Coffee beans  18.50",
        "Olive oil     14.00",
        "Chicken       10.50",
        "----------------------",
        "TOTAL         62.40",
        "Paid: card",
    ]
    image = Image.new("RGB", (224, 224), "white")
    draw = ImageDraw.Draw(image)
    for row, text in enumerate(lines):
        draw.text((12, 8 + row * 17), text, fill="black")
    return image


_IMAGES = {"receipt": receipt_image}


def materialize_request(item: dict[str, Any]) -> dict[str, Any]:
    """A suite item as a SystemOne request body: image names become PIL images, canary metadata is dropped."""
    request = {key: copy.deepcopy(item[key]) for key in REQUEST_KEYS if key in item}
    image = item.get("image")
    if image is not None:
        names = [image] if isinstance(image, str) else list(image)
        unknown = [name for name in names if name not in _IMAGES]
        if unknown:
            raise BlazeError(f"unknown suite image {unknown[0]!r}; known images: {sorted(_IMAGES)}")
        request["images"] = list(request.get("images") or []) + [_IMAGES[name]() for name in names]
    return request


def validate_request(item: dict[str, Any], where: str) -> None:
    """Check a suite item is a SystemOne request the release accepts; raise BlazeError naming the problem."""
    if not isinstance(item.get("model"), str):
        raise BlazeError(f"{where}: a SystemOne request needs a string 'model'")
    if "state" not in item:
        raise BlazeError(f"{where}: a SystemOne request needs a 'state'")
    questions = item.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise BlazeError(f"{where}: 'questions' must be a non-empty object of question id -> question")
    for qid, question in questions.items():
        kind = question.get("type") if isinstance(question, dict) else None
        if kind not in ("noul", "choice", "score"):
            raise BlazeError(f"{where}: question {qid!r}: type must be noul, choice or score")
        if kind != "noul" and not question.get("criteria"):
            raise BlazeError(f"{where}: question {qid!r}: criteria must not be empty")
    for qid in item.get("labels") or {}:
        if qid not in questions:
            raise BlazeError(f"{where}: label for unknown question {qid!r}")


@lru_cache(maxsize=1)
def _decision_items() -> tuple[str, ...]:
    items = read_jsonl(SUITES_DIR / "decisions.jsonl")
    for index, item in enumerate(items):
        validate_request(item, f"decisions.jsonl item {index}")
    return tuple(json.dumps(item) for item in items)


def default_decision_suite() -> list[dict[str, Any]]:
    """The typed-decision canaries as suite items (`labels` and `id` kept; images attached).

    The first item is the model card's invoice request. Pass items through `materialize_request` (or
    `request_bodies`) before giving them to a model; the canary runner does this itself.
    """
    items = [json.loads(text) for text in _decision_items()]
    for item in items:
        if "image" in item:
            item.update({"images": materialize_request(item)["images"]})
            del item["image"]
    return items


def request_bodies(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SystemOne request bodies for suite items (metadata such as `labels` removed)."""
    return [materialize_request(item) for item in items]


def load_custom_suite(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """Load `--suite FILE`: JSONL of chat prompts (`{"prompt": ...}`) or of SystemOne requests.

    Returns ("freeform", items) or ("decisions", items). Mixed files are refused.
    """
    items = read_jsonl(Path(path))
    kinds = {"decisions" if "questions" in item else "freeform" if "prompt" in item else "unknown" for item in items}
    if "unknown" in kinds:
        raise BlazeError(f"{path}: each line needs either 'prompt' (chat canary) or 'questions' (SystemOne request)")
    if len(kinds) > 1:
        raise BlazeError(f"{path}: mixes chat prompts and SystemOne requests; use one file per kind")
    kind = kinds.pop()
    for index, item in enumerate(items):
        if kind == "decisions":
            validate_request(item, f"{path} line item {index + 1}")
        elif not isinstance(item["prompt"], (str, list)) or not item["prompt"]:
            raise BlazeError(f"{path} item {index + 1}: 'prompt' must be a string or a list of chat messages")
    return kind, items
