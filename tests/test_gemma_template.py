"""The few-shot chat template that drives the pretrained Gemma 3 270M base as a chat model (catalogue `gemma3-270m`).

Gemma 3 270M in the catalogue is the pretrained base, not the `-it` model. Measured on CPU, it never emits
Gemma's `<end_of_turn>` token (probability below 1e-4, rank above 10 000, even after three in-context
examples that end with it), so a template in Gemma's own turn format runs every answer to the token cap.
The catalogue's template therefore renders three fixed example turns in plain text ("User: <question>", then
"Assistant:" and the answer on its own line, turns separated by a blank line) and stops on the blank-line token
`"\\n\\n"`, which the base does produce after an answer. These tests render the template with transformers'
Jinja machinery (the same path `Runtime.chat_text` takes), without loading the model.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from clef_model import embedded
from variants.spec import list_behaviors, load_behavior

SHOT = re.compile(r"User: (?P<question>[^\n]+)\nAssistant:\n(?P<answer>[^\n]+)\n\n")
WANTED = "Answer in as few words as possible. Give only the key fact."


@pytest.fixture(scope="module")
def gemma() -> embedded.EmbeddedModel:
    return embedded.embedded_model("gemma3-270m")


def _render(model: embedded.EmbeddedModel, messages: list[dict], *, generation_prompt: bool = True) -> str:
    assert model.chat_template is not None
    out: Any = render_jinja_template([messages], chat_template=model.chat_template,
                                     add_generation_prompt=generation_prompt, bos_token="<bos>")
    # transformers annotates a str but returns (rendered conversations, generation indices)
    return out if isinstance(out, str) else out[0][0]


def _turn(question: str, answer: str) -> str:
    return f"User: {question}\nAssistant:\n{answer}\n\n"


def _shots(text: str) -> list[tuple[str, str]]:
    """The example turns at the start of a rendered prompt (after the bos token)."""
    assert text.startswith("<bos>")
    shots, position = [], len("<bos>")
    while match := SHOT.match(text, position):
        shots.append((match["question"], match["answer"]))
        position = match.end()
    return shots


def test_question_follows_three_fixed_example_turns_and_ends_with_the_generation_prompt(gemma) -> None:
    text = _render(gemma, [{"role": "user", "content": "  How do I sharpen a pencil?  "}])
    shots = _shots(text)
    assert len(shots) == 3
    examples = "".join(_turn(q, a) for q, a in shots)
    assert text == f"<bos>{examples}User: How do I sharpen a pencil?\nAssistant:\n"
    # the examples are the same whatever the question (fixed, not chosen per prompt)
    assert _shots(_render(gemma, [{"role": "user", "content": "Other?"}])) == shots


def test_example_answers_are_one_to_three_sentences_and_end_at_the_stop_token(gemma) -> None:
    assert gemma.stop_tokens == ("\n\n",)
    for question, answer in _shots(_render(gemma, [{"role": "user", "content": "Q?"}])):
        sentences = re.findall(r"[.!?](?:\s|$)", answer)
        assert 1 <= len(sentences) <= 3, answer
        assert question.endswith("?") and "\n" not in answer


def test_system_prompt_reaches_the_model_once_before_the_first_question(gemma) -> None:
    chat = [
        {"role": "system", "content": WANTED},
        {"role": "user", "content": "What is the capital of Narnia?"},
        {"role": "assistant", "content": "Cair Paravel."},
        {"role": "user", "content": "I think you are wrong."},
    ]
    text = _render(gemma, chat)
    examples_end = sum(len(_turn(q, a)) for q, a in _shots(text)) + len("<bos>")
    assert text[examples_end:] == (
        f"User: {WANTED}\nWhat is the capital of Narnia?\nAssistant:\nCair Paravel.\n\n"
        "User: I think you are wrong.\nAssistant:\n"
    )
    assert text.count(WANTED) == 1
    # without a system message nothing is added before the question
    plain = _render(gemma, chat[1:])
    assert WANTED not in plain and plain[examples_end:].startswith("User: What is the capital of Narnia?\n")


def test_rendering_without_generation_prompt_closes_the_last_assistant_turn_as_generation_would(gemma) -> None:
    text = _render(gemma, [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}],
                   generation_prompt=False)
    assert text.endswith("User: Q?\nAssistant:\nA.\n\n")
    # the prompt plus the answer plus the stop token is the rendered chat: surgery appends a response's tokens
    # to the prompt's, and the answer starts a line, so it is tokenized as the model writes it
    prompt = _render(gemma, [{"role": "user", "content": "Q?"}])
    assert prompt.endswith("\n") and prompt + "A." + gemma.stop_tokens[0] == text


def test_example_questions_are_in_no_behaviour_split(gemma) -> None:
    """The examples must not hand the model the answer to a training, validation or held-out item."""
    def norm(text: str) -> str:
        return " ".join(text.lower().split()).rstrip("?.! ")

    shots = {norm(q) for q, _ in _shots(_render(gemma, [{"role": "user", "content": "Q?"}]))}
    for name in list_behaviors():
        spec = load_behavior(name)
        items = ([p["prompt"] for p in spec.to_contrast_pairs()] + [i["prompt"] for i in spec.validation_items()]
                 + [i["prompt"] for i in spec.heldout_items()])
        for prompt in items:
            texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
            assert not shots & {norm(t) for t in texts}, f"a few-shot question of gemma3-270m is in {name}"


@pytest.mark.parametrize("alias", embedded.embedded_aliases())
def test_catalogue_template_change_renames_the_converted_folder(alias: str) -> None:
    """The template and stop tokens are baked into the converted folder, which is reused by name.

    A catalogue entry with its own template carries the first 8 hex digits of the SHA-256 of
    `json.dumps([chat_template, stop_tokens])` at the end of its folder name, so editing either one
    converts afresh instead of silently reusing an old conversion.
    """
    model = embedded.embedded_model(alias)
    if model.chat_template is None:
        assert not model.stop_tokens  # stop tokens without a catalogue template would not reach a new folder either
        return
    key = hashlib.sha256(json.dumps([model.chat_template, list(model.stop_tokens)]).encode()).hexdigest()[:8]
    assert model.folder.endswith(f"-t{key}"), f"{alias}: the template or stop tokens changed; end `folder` with -t{key}"
