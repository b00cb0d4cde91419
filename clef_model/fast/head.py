"""The release's joint head, vectorised: all questions and options at once, without host syncs.

Opt-in only (``BLAZE_FAST_HEAD=vector``, allowlisted release code): it reorders the head's bf16
roundings, so it is not bit-compatible with the release head (see :func:`vector_head_requested`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class HeadPlan:
    """Index tensors describing one encoded record, built on the host before the backbone runs.

    Built ahead so the head can be queued without host syncs while the backbone graph still runs:
    averaging matrices for question spans ``[Q, L]``, option spans ``[O, L]`` and option tokens
    ``[O, n]`` (float32), the option tokens' ids ``[n]``, each option's question ``[O]``, each
    question's type ``[Q]``, question/option membership ``[Q, O]`` and the options per question.
    """

    length: int
    question_mean: torch.Tensor
    option_mean: torch.Tensor
    token_mean: torch.Tensor
    token_ids: torch.Tensor
    option_question: torch.Tensor
    types: torch.Tensor
    member: torch.Tensor
    counts: list[int]


def head_plan(record: Any, device: torch.device) -> HeadPlan:
    """The :class:`HeadPlan` of one release ``EncodedRecord`` (text only)."""
    length = len(record.input_ids)
    spans_q = [q.question_span for q in record.questions]
    spans_o = [span for q in record.questions for span in q.option_spans]
    counts = [len(q.option_spans) for q in record.questions]

    def averaging(spans: list[tuple[int, int]], width: int) -> torch.Tensor:
        matrix = torch.zeros(len(spans), width)
        for row, (start, end) in enumerate(spans):
            matrix[row, start:end] = 1.0 / (end - start)
        return matrix

    token_ids = [record.input_ids[i] for start, end in spans_o for i in range(start, end)]
    offsets, spans_tok = 0, []
    for start, end in spans_o:
        spans_tok.append((offsets, offsets + end - start))
        offsets += end - start
    option_question = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    member = torch.zeros(len(counts), len(spans_o), dtype=torch.bool)
    member[option_question, torch.arange(len(spans_o))] = True
    move = lambda t: t.to(device)  # noqa: E731
    return HeadPlan(
        length=length,
        question_mean=move(averaging(spans_q, length)),
        option_mean=move(averaging(spans_o, length)),
        token_mean=move(averaging(spans_tok, len(token_ids))),
        token_ids=move(torch.tensor(token_ids, dtype=torch.long)),
        option_question=move(option_question),
        types=move(torch.tensor([q.question_type for q in record.questions], dtype=torch.long)),
        member=move(member),
        counts=counts,
    )


def head_logits(head: Any, hidden: torch.Tensor, plan: HeadPlan,
                output_embedding: torch.Tensor) -> list[torch.Tensor]:
    """The release ``JointSchemaHead``'s per-question option logits for one record, vectorised.

    Same modules and the same function of the hidden states as the release head, computed for all
    questions and options at once (span means as averaging matmuls in float32, per-question routing as a
    masked softmax) instead of Python loops with host syncs. ``hidden``: ``[L, hidden]`` of that record.
    """
    dtype = hidden.dtype
    seq = head.hidden_norm(hidden[: plan.length])
    seq32 = seq.float()
    memory = head.memory_projection(seq).unsqueeze(0)
    global_vector = seq[-1]
    questions = (plan.question_mean @ seq32).to(dtype)
    contexts = (plan.option_mean @ seq32).to(dtype)
    lexical = (plan.token_mean @ output_embedding[plan.token_ids].float()).to(dtype)
    routed = (head.option_context_projection(contexts) + head.option_lexical_projection(lexical)
              + head.option_question_projection(questions)[plan.option_question]).unsqueeze(0)
    for layer in head.evidence_layers:
        routed = layer(routed, memory)
    routed = routed[0]
    base = head.question_projection(questions)
    scores = (base @ routed.T) / math.sqrt(routed.shape[-1])
    weights = torch.softmax(scores.masked_fill(~plan.member, float("-inf")), dim=-1)
    summaries = weights.to(routed.dtype) @ routed
    fields = (base + head.option_summary_norm(summaries) + head.global_projection(global_vector).unsqueeze(0)
              + head.type_embedding(plan.types)).unsqueeze(0)
    for layer in head.layers:
        fields = layer(fields, memory)
    fields = head.field_norm(fields[0])
    anchor = F.normalize(questions + global_vector, dim=-1)[plan.option_question]
    lexical_anchor = F.normalize(lexical, dim=-1)
    prior = head.prior_logit_scale.clamp(max=math.log(100.0)).exp() * (lexical_anchor * anchor).sum(-1)
    options = head.option_norm(routed)
    field = fields[plan.option_question]
    cosine = F.cosine_similarity(field, options, dim=-1)
    features = torch.cat([field, options, field * options, torch.abs(field - options)], dim=-1)
    residual = head.residual_scorer(features).squeeze(-1)
    joint = head.joint_logit_scale.clamp(max=math.log(100.0)).exp() * cosine + residual
    logits = prior + torch.sigmoid(head.residual_gate) * joint
    return list(torch.split(logits, plan.counts))


def vector_head_requested(release_code: ModuleType | None) -> bool:
    """Whether to score with :func:`head_logits` instead of the release's head: only on request
    (``BLAZE_FAST_HEAD=vector``) and only for the allowlisted release code.

    Off by default because it cannot meet the 1e-3 agreement in bf16: it reorders the head's roundings,
    and the release head's own bf16 result is ~1e-2 (in probability) away from its float32 result on the
    9B head shapes, so any reordering lands that far from the reference (measured: max |Δp| 0.0078
    on the GPU, 0.0078 on the CPU). In float32 it agrees to 1e-4 (tests). It saves ~4 ms per request.
    """
    from clef_model.env import fast_head

    return fast_head() == "vector" and known_head(release_code)


def known_head(release_code: ModuleType | None) -> bool:
    """Whether ``release_code`` is Cloudflare's allowlisted release code, whose head :func:`head_logits`
    re-expresses; for any other (trusted) code the release's own head runs."""
    from pathlib import Path

    from clef_model.trust import is_known_release_code

    path = getattr(release_code, "__file__", None)
    if not path:
        return False
    return is_known_release_code(Path(path))
