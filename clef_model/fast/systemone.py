"""The release's ``systemone`` answer with its backbone run from a CUDA graph (:class:`FastSystemOne`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from clef_model.fast.engine import QwenEngine
from clef_model.fast.graphs import GraphedBackbone, default_buckets
from clef_model.fast.head import head_logits, head_plan, vector_head_requested


class FastSystemOne:
    """The release's ``systemone`` with the backbone run by :class:`GraphedBackbone`.

    ``release_code`` is the release's ``joint_schema_model`` module (for ``encode_record``,
    ``collate_records`` and ``systemone_answer``); ``head`` is its loaded ``JointSchemaHead``. Requests
    with images or videos go to ``reference`` (the release path), as does anything this path does
    not validate, so errors read exactly as the release's.
    """

    def __init__(self, backbone_model: torch.nn.Module, head: torch.nn.Module, tokenizer: Any,
                 release_code: ModuleType, reference: Callable[[dict], dict], *, processor: Any = None,
                 buckets: Sequence[int] = default_buckets(), use_graphs: bool | None = None,
                 pad_to_bucket: bool | None = None, vector_head: bool | None = None) -> None:
        self.engine = QwenEngine(backbone_model)
        self.head = head
        self.tokenizer = tokenizer
        self.processor = processor
        self.code = release_code
        self.reference = reference
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.backbone = GraphedBackbone(self.engine, buckets=buckets, pad_token_id=pad, use_graphs=use_graphs,
                                        pad_to_bucket=pad_to_bucket)
        self.vector_head = vector_head if vector_head is not None else vector_head_requested(release_code)

    def _plain(self, request: dict) -> bool:
        questions = request.get("questions")
        if request.get("images") or request.get("videos"):
            return False
        if not isinstance(request.get("model"), str) or "state" not in request:
            return False
        if not isinstance(questions, dict) or not questions:
            return False
        types = getattr(self.code, "QUESTION_TYPES", {"noul": 0, "choice": 1, "score": 2})
        return all(
            isinstance(q, dict) and q.get("type") in types and (q["type"] == "noul" or q.get("criteria"))
            for q in questions.values()
        )

    @torch.inference_mode()
    def probabilities(self, request: dict, max_length: int = 16384) -> tuple[Any, list[dict[str, float]]]:
        """Encode ``request`` and return ``(encoded record, per-question option probabilities)``."""
        encoded = self.code.encode_record(self.tokenizer, request, max_length=max_length)
        batch = self.code.collate_records([encoded], self.tokenizer.pad_token_id or 0, self.engine.device)
        plan = head_plan(encoded, self.engine.device) if self.vector_head else None
        hidden = self.backbone(batch["input_ids"])  # queued; the head below queues behind it, no host sync
        if plan is not None:
            logits = head_logits(self.head, hidden[0], plan, self.engine.lm_head.weight)
        else:
            logits = self.head(hidden, batch["input_ids"], batch["attention_mask"], batch["records"],
                               self.engine.lm_head.weight)[0]
        probs = [dict(zip(q.option_ids, lg.float().softmax(-1).tolist(), strict=True)) for q, lg in zip(encoded.questions, logits, strict=True)]
        return encoded, probs

    def __call__(self, request: dict, max_length: int = 16384) -> dict:
        """A SystemOne response body, as the release's ``systemone`` returns it."""
        if not self._plain(request):
            return self.reference(request)
        encoded, probs = self.probabilities(request, max_length=max_length)
        questions = request["questions"]
        answers = {
            q.question_id: self.code.systemone_answer(questions[q.question_id], p)
            for q, p in zip(encoded.questions, probs, strict=True)
        }
        return {
            "model": request["model"],
            "answers": answers,
            "usage": {"input_tokens": len(encoded.input_ids), "output_tokens": 0},
        }
