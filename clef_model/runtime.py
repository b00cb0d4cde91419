"""One loaded release, two faces: typed decisions (`systemone`) and free-form chat (`generate`).

A Clef release is loaded once through its own code (`load_release_model`), so decisions come from
Cloudflare's head and encoding, not a re-implementation: `systemone` returns exactly the release's
response body. The same backbone object (a `Qwen3_5ForConditionalGeneration`) serves `generate`, with
the KV cache switched back on (the release loader turns it off), and gives surgery direct access to its
decoder layers and linear modules, keyed by their on-disk tensor names. Plain Hugging Face causal LMs
(Llama, Qwen2, Qwen3, Qwen3.5 text) load through the same resolver and offer everything but decisions.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from clef_model import env
from clef_model import fast as _fast  # optional fast paths (issue 6); each hook falls back to the reference
from clef_model.backbone import text_decoder
from clef_model.errors import BlazeError, ReleaseError, RequestError  # RequestError: re-exported here
from clef_model.files import JOINT_HEAD
from clef_model.greedy import greedy_pruned, left_padded
from clef_model.images import resolve_request_images
from clef_model.release import Release, resolve_release
from clef_model.trust import load_release_code

Prompt = str | list[dict]


@dataclass
class Generation:
    """One generated answer: its text (special tokens removed) and token counts."""

    text: str
    prompt_tokens: int
    new_tokens: int  # generated tokens, not counting the stop token
    token_ids: list[int]  # the generated ids, without the stop token
    hit_limit: bool  # stopped because max_new_tokens was reached, not at a stop token


@dataclass
class GenerationStats:
    """What `Runtime.generate` has done so far: calls, answers, new tokens, decode steps and seconds.

    Kept so `blaze edit` can say where its time went (its timing line) without a profiler: on a CPU the
    generation passes of the strength search and the canaries are most of an edit after the statistics.
    """

    calls: int = 0
    answers: int = 0
    new_tokens: int = 0
    steps: int = 0  # decode steps summed over batches (a batch runs until its longest answer ends)
    seconds: float = 0.0

    def text(self) -> str:
        """``generated 130 answers (6,210 tokens, 1,152 batch steps) in 88.0 s``."""
        return (f"generated {self.answers} answers ({self.new_tokens:,} tokens, {self.steps:,} batch steps) "
                f"in {self.seconds:.1f} s")


def default_device() -> torch.device:
    """cuda when available, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# A plain chat model whose weight files take at most this many bytes runs in float32 on CUDA by default (about 2B
# parameters stored in bfloat16: 8 GB in float32). See `default_dtype`.
FLOAT32_ON_CUDA_MAX_BYTES = 4 * 10**9


def default_dtype(device: torch.device, release: Release | None = None) -> torch.dtype:
    """The compute dtype when the user names none: float32 on the CPU; on CUDA bfloat16, except for a plain chat
    model (not Clef) whose weight files take ≤ 4 GB, which runs in float32.

    Why: in bfloat16 a greedy answer moves with the batch alone (Gemma 3 270M unedited on an H200: 17 of 160
    answers changed and one more looped between batch 16 and 7, against 0 of 160 in float32; BENCHMARKS "One
    H200, round 6"), and the search's verdicts (one new loop in 134 answers) sit at that noise. A small model in
    float32 costs no more time on a GPU (its decode is launch-bound: 16.0 s in float32 against 35.3 s in
    bfloat16 for those 160 answers) and gives the CPU's verdicts (the same search table to three decimals).
    Clef keeps bfloat16, the release's own dtype, so its answers match the release's."""
    if device.type != "cuda":
        return torch.float32
    if release is not None and release.kind != "clef" and _weight_bytes(release) <= FLOAT32_ON_CUDA_MAX_BYTES:
        return torch.float32
    return torch.bfloat16


def _weight_bytes(release: Release) -> int:
    """Bytes of the release's safetensors weight files (what its parameters take as stored)."""
    return sum(path.stat().st_size for path in Path(release.path).glob("*.safetensors") if path.is_file())


def generation_batch_size(device: torch.device | str) -> int:
    """Prompts per generation batch when the user gives none: 128 on the CPU, 16 on a GPU.

    On the CPU a decode step reads every weight once, whatever the rows: SmolLM2-135M at 2 cores took
    159 ms a step at 8 rows and 469 ms at 64, i.e. 20 ms against 7.3 ms per answer row; 128 training
    questions took 70.0 s at 128 rows against 102.1 s at 64 (BENCHMARKS.md, "The README's main job,
    round 5"). With stopped answers leaving the batch (`clef_model.greedy`) a large batch wastes nothing.
    On a GPU 16 is what the canary always used, and the edit now uses it too, so the edit's final canary
    and `blaze canary` share the base's cached answers."""
    return 128 if torch.device(device).type == "cpu" else 16


_QUESTION_TYPES = ("noul", "choice", "score")


def _kind(value: Any) -> str:
    """A JSON type name for messages ("a string", "a list", ...)."""
    for kind, name in ((bool, "a boolean"), (str, "a string"), (dict, "an object"), (list, "a list"),
                       (int, "a number"), (float, "a number"), (type(None), "null")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def validate_request(request: Any) -> None:
    """The checks the release's `systemone` makes (same first messages), plus the shapes its encoder assumes.

    Raises RequestError naming the field, e.g. `questions.q1.criteria: must be an object mapping option ids
    to descriptions for a choice question (got a string)`, so a malformed request never reaches the release
    code (where it would fail with a KeyError or AttributeError deep inside the encoder).
    """
    if not isinstance(request, dict):
        raise RequestError(f"request must be a JSON object (got {_kind(request)})")
    if not isinstance(request.get("model"), str) or "state" not in request:
        raise RequestError("model and state are required")
    questions = request.get("questions")
    if isinstance(questions, list):
        raise RequestError("questions: must be an object mapping question ids to questions "
                           '(got a list; write {"q1": {...}, "q2": {...}})')
    if questions is not None and not isinstance(questions, dict):
        raise RequestError(f"questions: must be an object mapping question ids to questions (got {_kind(questions)})")
    if not questions:
        raise RequestError("at least one question is required")
    for question_id, question in questions.items():
        _validate_question(question_id, question)


def _validate_question(question_id: str, question: Any) -> None:
    """One question of a SystemOne request (see `validate_request`)."""
    where = f"questions.{question_id}"
    if not question_id.strip():  # the release answers an empty id with NaN, which is not JSON
        raise RequestError("questions: a question id must be a non-empty name (got an empty or blank key)")
    if not isinstance(question, dict) or question.get("type") not in _QUESTION_TYPES:
        raise RequestError(f"{question_id}: type must be noul, choice, or score")
    criteria = question.get("criteria")
    if question["type"] != "noul" and not criteria:
        raise RequestError(f"{question_id}: criteria must not be empty")
    if question["type"] == "choice" and not isinstance(criteria, dict):
        raise RequestError(f"{where}.criteria: must be an object mapping option ids to descriptions for a "
                           f"choice question (got {_kind(criteria)})")
    if question["type"] == "score" and not isinstance(criteria, list):
        raise RequestError(f"{where}.criteria: must be a list of level descriptions for a score question "
                           f"(got {_kind(criteria)})")
    if question["type"] == "noul" and criteria is not None:
        if not isinstance(criteria, dict) or not set(criteria) <= {"true", "false"}:
            raise RequestError(f"{where}.criteria: a noul question's criteria, when given, must be an object "
                               'with at most the keys "true" and "false"')


class Runtime:
    """A release loaded once: `systemone`, `generate`, and module access for surgery."""

    def __init__(
        self,
        release: Release,
        model: torch.nn.Module,
        tokenizer: Any,
        processor: Any | None,
        device: torch.device,
        dtype: torch.dtype,
        clef: torch.nn.Module | None = None,
        release_code: ModuleType | None = None,
    ):
        self.release = release
        # a transformers model (or a peft wrapper of one): its config and methods are built at run time,
        # which torch.nn.Module's attribute typing (Tensor | Module) cannot express
        self.model: Any = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.device = device
        self.dtype = dtype
        self.clef = clef
        self.release_code = release_code
        self.is_clef = clef is not None
        self._chat_template = self._read_chat_template()
        self._named_linears: dict[str, torch.nn.Linear] | None = None
        self.warnings: list[str] = []  # things a report should mention (e.g. a state cut to fit)
        self.generation_stats = GenerationStats()  # counters of `generate` (blaze edit's timing line)

    # -- loading ---------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        ref: str | Release,
        *,
        revision: str | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        trust_release_code: bool = False,
    ) -> Runtime:
        """Resolve, validate and load a release once (Clef through its own code, else AutoModelForCausalLM)."""
        release = ref if isinstance(ref, Release) else resolve_release(ref, revision)
        from clef_model.env import quiet

        if quiet():
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or default_dtype(device, release)
        _check_weight_files(release)
        if release.kind == "clef":
            code = load_release_code(release, trust_release_code)
            try:
                clef, processor = code.load_release_model(release.path, device=str(device), dtype=dtype)
            except Exception as error:  # noqa: BLE001 - damaged release files fail in many library types
                raise ReleaseError(_load_failure(release, error)) from error
            backbone = clef.language_model
            _enable_cache(backbone)
            return cls(release, backbone, processor.tokenizer, processor, device, dtype, clef, code)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(release.path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(release.path)
        except Exception as error:  # noqa: BLE001 - damaged release files fail in many library types
            raise ReleaseError(_load_failure(release, error)) from error
        model = model.to(device).eval()
        _enable_cache(model)
        return cls(release, model, tokenizer, None, device, dtype)

    def _read_chat_template(self) -> str | None:
        path = self.release.path / "chat_template.jinja"
        if path.is_file():
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise ReleaseError(f"{path} is unreadable ({error}); the release is damaged, re-download it.") from None
        return getattr(self.tokenizer, "chat_template", None)

    # -- typed decisions ------------------------------------------------------------------------------
    def _require_clef(self) -> ModuleType:
        if not self.is_clef:
            raise BlazeError(
                f"{self.release.ref} is a plain causal LM ({self.release.architecture}) without a joint head; "
                "typed decisions (systemone) need a Clef release such as Cloudflare/clef-flash."
            )
        assert self.release_code is not None  # a Clef release is loaded with its release code
        return self.release_code

    def encode_requests(self, requests: list[dict], max_length: int = 16384) -> list[Any]:
        """Encode SystemOne requests with the release's own `encode_record` (validated like the release)."""
        code = self._require_clef()
        encoded = []
        for index, request in enumerate(requests):
            validate_request(request)
            request = resolve_request_images(request)  # [issue 13/14: clef_model/images.py] no fetch offline
            record = code.encode_record(self.tokenizer, request, max_length=max_length, processor=self.processor)
            if len(record.input_ids) >= max_length:
                self._warn_if_state_cut(code, request, record, max_length, index)
            encoded.append(record)
        return encoded

    def _warn_if_state_cut(self, code: ModuleType, request: dict, record: Any, max_length: int, index: int) -> None:
        """Warn (stderr, and `self.warnings` for reports) when the release's encoder cut the state to fit.

        The release truncates `state` silently to `max_length` tokens in all; the decision is then made on
        part of the state. Only a request that fills `max_length` exactly is re-tokenised to check.
        """
        state_tokens = len(code._tokens(self.tokenizer, code.render(request["state"])))
        kept = len(record.input_ids) - (self._fixed_tokens(code, request, record) or 0)
        if state_tokens > kept:
            message = (f"request {index}: its state is {state_tokens} tokens; only the first {kept} were used "
                       f"(the input is capped at {max_length} tokens). Shorten the state to decide on all of it.")
            self.warnings.append(message)
            print(f"warning: {message}", file=sys.stderr)

    def _fixed_tokens(self, code: ModuleType, request: dict, record: Any) -> int | None:
        """Tokens of the record that are not state: everything but the state span."""
        state_only = code.encode_record(self.tokenizer, {**request, "state": ""}, max_length=10**9,
                                        processor=self.processor)
        empty_state = len(code._tokens(self.tokenizer, code.render("")))
        return len(state_only.input_ids) - empty_state

    @torch.inference_mode()
    def _option_probabilities(
        self, requests: list[dict], batch_size: int, max_length: int,
        batching: _fast.BatchingSettings | None = None,
    ) -> tuple[list[Any], list[dict[str, dict[str, float]]]]:
        """Encode, batch (right padding, similar lengths together) and run the head; unrounded probabilities.

        Without ``batching``: sorted by length, ``batch_size`` per forward. With it (``systemone_batch``):
        the length-aware plan of :func:`clef_model.fast.plan_batches`, batches of two or more rows through
        the fast batched backbone when it is on.
        """
        code = self._require_clef()
        if batch_size < 1:
            raise BlazeError(f"batch size must be at least 1 (got {batch_size}).")
        encoded = self.encode_requests(requests, max_length)
        if batching is None:
            order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
            chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
        else:
            chunks = _fast.plan_batches([len(record.input_ids) for record in encoded], batching)
        results: list[dict[str, dict[str, float]] | None] = [None] * len(encoded)
        for chunk in chunks:
            batch = code.collate_records([encoded[i] for i in chunk], self.tokenizer.pad_token_id, self.device)
            # [fast path, issue 6: clef_model/fast/hooks.py] batch-1 text requests through a CUDA-graphed backbone;
            # [issue 15] a length-aware batch of several through the same backbone, padded to one bucket
            if batching is not None and len(chunk) > 1:
                logits = _fast.clef_logits_rows(self, batch, graph_tokens=batching.graph_tokens)
            else:
                logits = _fast.clef_logits(self, batch)
            if logits is None:
                assert self.clef is not None  # _require_clef passed
                logits = self.clef(batch)
            for i, record_logits in zip(chunk, logits, strict=True):
                results[i] = {
                    question.question_id: dict(
                        zip(question.option_ids, question_logits.float().softmax(-1).tolist(), strict=True)
                    )
                    for question, question_logits in zip(encoded[i].questions, record_logits, strict=True)
                }
        return encoded, results  # type: ignore[return-value]

    def decision_probabilities(
        self, requests: list[dict], batch_size: int = 8, max_length: int = 16384
    ) -> list[dict[str, dict[str, float]]]:
        """Unrounded probabilities per request: question id -> option id -> probability."""
        return self._option_probabilities(requests, batch_size, max_length)[1]

    def systemone_batch(self, requests: list[dict], batch_size: int = 8, max_length: int = 16384, *,
                        batching: _fast.BatchingSettings | None = None) -> list[dict]:
        """SystemOne response bodies for several requests, in the caller's order; at most `batch_size` per forward.

        Length-aware [issue 15]: requests are sorted by length and grouped only while the padded batch
        stays within `batching`'s token budget and padding bound (defaults: `BatchingSettings()`; its
        `max_rows` is replaced by `batch_size`), so mixed lengths do not pay for padding to the longest.
        A request left alone in its group runs exactly the one-at-a-time path of `systemone`.
        """
        code = self._require_clef()
        if batch_size < 1:
            raise BlazeError(f"batch size must be at least 1 (got {batch_size}).")
        settings = dataclasses.replace(batching or _fast.BatchingSettings(), max_rows=batch_size)
        encoded, probabilities = self._option_probabilities(requests, batch_size, max_length, settings)
        responses = []
        for request, record, record_probabilities in zip(requests, encoded, probabilities, strict=True):
            answers = {
                question.question_id: code.systemone_answer(
                    request["questions"][question.question_id], record_probabilities[question.question_id]
                )
                for question in record.questions
            }
            responses.append(
                {
                    "model": request["model"],
                    "answers": answers,
                    "usage": {"input_tokens": len(record.input_ids), "output_tokens": 0},
                }
            )
        return responses

    def systemone(self, request: dict, max_length: int = 16384) -> dict:
        """The release's SystemOne response body for one request (same dict as its `systemone`)."""
        return self.systemone_batch([request], batch_size=1, max_length=max_length)[0]

    # -- free-form generation -------------------------------------------------------------------------
    def _messages(self, prompt: Prompt, system: str | None) -> list[dict]:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
            messages = [dict(m) for m in prompt]
        else:
            raise BlazeError("a prompt must be a string or a list of {'role', 'content'} messages.")
        if system is not None and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def chat_text(self, prompt: Prompt, system: str | None = None, generation_prompt: bool = True) -> str:
        """The prompt rendered by the release's chat template (with the generation prompt unless told
        otherwise; thinking off)."""
        if not self._chat_template:
            raise ReleaseError(f"{self.release.ref} has no chat template; free-form generation needs one.")
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                self._messages(prompt, system),
                chat_template=self._chat_template,
                add_generation_prompt=generation_prompt,
                enable_thinking=False,
                tokenize=False,
            )
        except TemplateError as error:
            raise ReleaseError(f"the chat template of {self.release.ref} does not render ({error}); "
                               "chat_template.jinja is damaged, re-download the release.") from None

    def chat_ids(self, prompt: Prompt, system: str | None = None, generation_prompt: bool = True) -> list[int]:
        """Token ids of the prompt through the release's chat template (add_generation_prompt unless told
        otherwise), thinking off."""
        return list(self.tokenizer(self.chat_text(prompt, system, generation_prompt),
                                   add_special_tokens=False).input_ids)

    def stop_token_ids(self) -> list[int]:
        """Token ids that end an answer: the generation config's eos ids and the tokenizer's eos."""
        ids: list[int] = []
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in configured if isinstance(configured, list) else [configured]:
            if value is not None and value not in ids:
                ids.append(int(value))
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(int(self.tokenizer.eos_token_id))
        return ids

    def _pad_id(self) -> int:
        for value in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if value is not None:
                return int(value)
        return 0

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[Prompt],
        *,
        max_new_tokens: int = 128,
        batch_size: int = 8,
        system: str | None = None,
    ) -> list[Generation]:
        """Greedy chat answers, `batch_size` prompts per call (left padding, KV cache on); deterministic."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if max_new_tokens < 1 or batch_size < 1:
            raise BlazeError("max_new_tokens and batch_size must be at least 1.")
        encoded = [self.chat_ids(prompt, system) for prompt in prompts]
        stops = self.stop_token_ids()
        pad = self._pad_id()
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        results: list[Generation | None] = [None] * len(encoded)
        started = time.perf_counter()
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            prompts_ids = [encoded[i] for i in chunk]
            # [fast path, issue 6: clef_model/fast/hooks.py] static caches + CUDA-graph decode; None -> reference
            rows = _fast.greedy_rows(self, prompts_ids, max_new_tokens, stops)
            if rows is None and self.clef is None and self.device.type == "cpu" and env.fast() is not False:
                # [issue 15] plain causal LMs on the CPU: stopped answers leave the batch (clef_model/greedy.py;
                # 1.6-3.2x faster there, where a decode step is bound by memory bandwidth and costs per row).
                # On a GPU a small model's step costs the same at any row count, and the one H200 comparison
                # (160 SmolLM2 answers, bf16) took 75.1 s against generate's 35.6 s, so generate stays.
                # BLAZE_FAST=0 keeps transformers' generate everywhere, the reference it is tested against.
                rows = greedy_pruned(self.model, prompts_ids, max_new_tokens, stops, pad, self.device)
            if rows is None:
                input_ids, attention_mask = left_padded(prompts_ids, pad)
                width = input_ids.shape[1]
                output = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    use_cache=True,
                    eos_token_id=stops,
                    pad_token_id=pad,
                )
                rows = [output[row, width:].tolist() for row in range(len(chunk))]
            self.generation_stats.steps += max(len(new) for new in rows)
            for row, i in enumerate(chunk):
                new = rows[row]
                stop_at = next((k for k, token in enumerate(new) if token in stops), None)
                kept = new if stop_at is None else new[:stop_at]
                results[i] = Generation(
                    text=self.tokenizer.decode(kept, skip_special_tokens=True).strip(),
                    prompt_tokens=len(encoded[i]),
                    new_tokens=len(kept),
                    token_ids=kept,
                    hit_limit=stop_at is None and len(new) >= max_new_tokens,
                )
                self.generation_stats.new_tokens += len(kept)
        counts = self.generation_stats
        counts.calls, counts.answers = counts.calls + 1, counts.answers + len(encoded)
        counts.seconds += time.perf_counter() - started
        return results  # type: ignore[return-value]

    # -- module access for surgery --------------------------------------------------------------------
    def text_model(self) -> torch.nn.Module:
        """The decoder stack (embeddings, layers, final norm): forward(input_ids, attention_mask) -> hidden states."""
        return text_decoder(self.model)

    def decoder_layers(self) -> list[torch.nn.Module]:
        """The backbone's decoder layers, in order."""
        return list(text_decoder(self.model).layers)

    def lm_head(self) -> torch.nn.Linear:
        """The output projection (its rows are also what the joint head reads for option tokens)."""
        return self.model.get_output_embeddings()

    def named_linears(self) -> dict[str, torch.nn.Linear]:
        """Linear modules keyed by their on-disk weight name without `.weight` (checked against the checkpoint)."""
        if self._named_linears is None:
            on_disk = set(self.release.weight_map())
            found: dict[str, torch.nn.Linear] = {}
            unmatched = []
            for name, module in self.model.named_modules():
                if not isinstance(module, torch.nn.Linear):
                    continue
                disk_name = _disk_name(name, on_disk)
                if disk_name is None:
                    if module.weight is not self.model.get_input_embeddings().weight:
                        unmatched.append(name)
                    continue
                found[disk_name] = module
            if unmatched:
                raise ReleaseError(
                    f"{len(unmatched)} linear module(s) of {self.release.ref} have no tensor on disk "
                    f"(first: {unmatched[0]}); the checkpoint does not match its config."
                )
            self._named_linears = found
        return dict(self._named_linears)

    def describe(self) -> dict:
        """A short JSON-able summary (for logs and reports)."""
        return {
            "ref": self.release.ref,
            "path": str(self.release.path),
            "revision": self.release.revision,
            "kind": self.release.kind,
            "architecture": self.release.architecture,
            "device": str(self.device),
            "dtype": str(self.dtype).replace("torch.", ""),
            "decoder_layers": len(self.decoder_layers()),
        }

    def __repr__(self) -> str:
        return f"Runtime({json.dumps(self.describe())})"


def _check_weight_files(release: Release) -> None:
    """Parse every safetensors header of the release (cheap: headers only) before a library loads them.

    A truncated or garbled shard (or joint head) then fails with a ReleaseError naming the file and saying
    to re-download it, instead of an error from deep inside safetensors or transformers.
    """
    from clef_model.checkpoint import CheckpointReader, read_header

    CheckpointReader(release.path)
    head = release.path / JOINT_HEAD
    if release.kind == "clef" and head.is_file():
        read_header(head)
        _check_head_finite(head)


def _check_head_finite(head) -> None:
    """Refuse a joint head holding NaN or infinite values: every decision would be NaN (or an error later).

    The head is small next to the backbone: 353 MB of float32 at 9B, checked in ≈ 0.3 s on the dev VM, in a
    load that reads 19 GB (the release loader then reads the head again from the page cache).
    """
    import numpy as np

    from clef_model.checkpoint import CheckpointReader

    reader = CheckpointReader(head)
    for name in reader.names():
        if reader.dtype(name) in ("F64", "F32", "F16", "BF16") and not np.isfinite(reader.array(name)).all():
            raise ReleaseError(f"{head}: tensor {name!r} holds NaN or infinite values, so every typed decision "
                               "would be NaN; the joint head is damaged. Re-download the release (or the variant).")


def _load_failure(release: Release, error: BaseException) -> str:
    """The message for a release whose files did not load (names the file when the error does)."""
    culprit = getattr(error, "filename", None)
    where = f" ({culprit})" if culprit else ""
    return (f"the release at {release.path} failed to load{where}: {type(error).__name__}: {error}. "
            "A file of the release is damaged or incompatible; re-download it (or rebuild the fixture).")


def _disk_name(module_name: str, on_disk: set[str]) -> str | None:
    """Map a live module name to its on-disk tensor name (without `.weight`), or None if not stored."""
    candidates = [module_name]
    if module_name.startswith("model.") and not module_name.startswith("model.language_model."):
        candidates.append("model.language_model." + module_name[len("model.") :])
    if module_name.startswith("model.language_model."):
        candidates.append("model." + module_name[len("model.language_model.") :])
    for candidate in candidates:
        if candidate + ".weight" in on_disk:
            return candidate
    return None


def _enable_cache(model: Any) -> None:
    """Switch the KV cache back on for generation (the release loader turns it off for the head)."""
    model.config.use_cache = True
    text_config = getattr(model.config, "text_config", None)
    if text_config is not None:
        text_config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
