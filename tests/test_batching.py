"""Length-aware SystemOne batching (issue 15): the plan's limits, and batched answers equal one-at-a-time ones.

The plan is a pure function (tested on random lengths). The runtime tests run on the tiny fixture, CPU,
float32, with the fast paths forced on (``BLAZE_FAST=1``) and the backbone padding every forward to its
length bucket, as the CUDA graphs do on a GPU, so the batched rows see exactly what they would there:
right padding to one bucket, several rows in one forward, the release head cut at each row's mask.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from clef_model import fast
from clef_model.errors import BlazeError
from clef_model.fast import BatchingSettings, GraphedBackbone, padded_length, plan_batches
from clef_model.runtime import Runtime

# Largest |Δp| allowed between a batched answer and the same request alone (unrounded probabilities,
# float32 on the CPU). Both paths run the same operations on the same real tokens; they differ only in
# matrix shapes (more rows per matmul), which may change float32 summation order (~1e-7 relative per
# operation). Measured on this fixture and these requests: 0.0 on the fast path (same bucket padding),
# 5.1e-7 on the release's batched forward. 1e-5 leaves room for other BLAS builds and is far below what a
# real fault moves: hidden states shifted by one position (test_bound_detects_a_padding_fault) moved
# probabilities by 0.14. On a GPU in bf16 the bar is instead the kernel-noise control (scripts/bench).
TOLERANCE = 1e-5


def _request(words: int, seed: int) -> dict:
    """A SystemOne request whose state grows with ``words`` (three question types)."""
    rng = random.Random(seed)
    note = " ".join(rng.choice(["late", "invoice", "paid", "march", "order", "refund", "ticket", "the"])
                    for _ in range(words))
    return {
        "model": "clef-flash",
        "state": {"invoice": f"INV-{seed}", "notes": note},
        "questions": {
            "overdue": {"type": "noul", "instructions": "Is the invoice overdue?"},
            "status": {"type": "choice", "instructions": "Status",
                       "criteria": {"paid": "fully paid", "overdue": "past due", "pending": "not due"}},
            "urgency": {"type": "score", "instructions": "Urgency", "criteria": ["low", "medium", "high"]},
        },
    }


# --- the plan ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_plan_respects_every_limit(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 5000) for _ in range(rng.randint(0, 60))]
    settings = BatchingSettings(max_rows=rng.choice([1, 2, 8, 32]), token_budget=rng.choice([512, 4096, 8192]),
                                overhead_tokens=rng.choice([0, 64, 256, 1024]), granularity=rng.choice([1, 64]))
    batches = plan_batches(lengths, settings)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))  # each exactly once
    for batch in batches:
        assert [lengths[i] for i in batch] == sorted(lengths[i] for i in batch)
        if len(batch) == 1:
            continue
        longest = padded_length(max(lengths[i] for i in batch), settings.granularity)
        own = sum(padded_length(lengths[i], settings.granularity) for i in batch)
        assert len(batch) <= settings.max_rows
        assert len(batch) * longest <= settings.token_budget
        assert len(batch) * longest - own <= (len(batch) - 1) * settings.overhead_tokens
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(lengths)  # batches run shortest first, neighbours together


def test_plan_groups_equal_lengths_and_separates_far_ones() -> None:
    settings = BatchingSettings(max_rows=4, token_budget=8192, overhead_tokens=256)
    assert plan_batches([300] * 10, settings) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # 200 and 1,000 tokens: merging adds 768 padded tokens for one extra row (> 256): kept apart
    assert plan_batches([1000, 200], settings) == [[1], [0]]
    # 3,000 tokens: two rows would be 6,144 ≤ 8,192, three 9,216 > budget
    assert plan_batches([3000, 3000, 3000], settings) == [[0, 1], [2]]
    # longer than the budget: alone
    assert plan_batches([9000, 100], settings) == [[1], [0]]


def test_settings_are_checked() -> None:
    with pytest.raises(BlazeError, match="token_budget must be at least 1"):
        BatchingSettings(token_budget=0)
    with pytest.raises(BlazeError, match="overhead_tokens must not be negative"):
        BatchingSettings(overhead_tokens=-1)


# --- the runtime ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runtime(tiny_release: Path) -> Runtime:
    """A private runtime (its fast-path caches are changed here), float32 on the CPU."""
    return Runtime.load(str(tiny_release), device="cpu", dtype=torch.float32)


@pytest.fixture()
def fast_on(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Fast paths on, forwards padded to 64-token buckets; returns the (rows, length) of each batched call."""
    monkeypatch.setenv("BLAZE_FAST", "1")
    engine = fast.QwenEngine(runtime.model)
    runtime.__dict__["_fast_backbone"] = GraphedBackbone(engine, pad_to_bucket=True,
                                                         pad_token_id=runtime.tokenizer.pad_token_id)
    runtime.__dict__.pop("_fast_failed", None)
    calls: list[tuple[int, int]] = []
    original = fast.clef_logits_rows

    def spy(rt, batch, graph_tokens=2048):
        calls.append(tuple(batch["input_ids"].shape))
        return original(rt, batch, graph_tokens)

    monkeypatch.setattr(fast, "clef_logits_rows", spy)
    return calls


REQUESTS = [_request(words, seed) for seed, words in enumerate([40, 3, 41, 120, 5, 39, 118, 4, 300, 42])]


def _probabilities(runtime: Runtime, requests: list[dict], settings: BatchingSettings) -> list[dict]:
    return runtime._option_probabilities(requests, settings.max_rows, 16384, settings)[1]


def _worst(a: list[dict], b: list[dict]) -> float:
    return max(abs(x[q][o] - y[q][o]) for x, y in zip(a, b, strict=True) for q in x for o in x[q])


def test_batched_answers_equal_one_at_a_time_in_callers_order(runtime, fast_on) -> None:
    settings = BatchingSettings(max_rows=8, token_budget=2048, overhead_tokens=64)
    lengths = [len(record.input_ids) for record in runtime.encode_requests(REQUESTS)]
    plan = plan_batches(lengths, settings)
    assert max(len(batch) for batch in plan) >= 3  # the test must exercise real multi-row batches
    single = [runtime.systemone(r) for r in REQUESTS]
    alone = [_probabilities(runtime, [r], settings)[0] for r in REQUESTS]
    assert not fast_on  # one request alone never takes the batched path
    batched = _probabilities(runtime, REQUESTS, settings)
    assert sorted(rows for rows, _ in fast_on) == sorted(len(b) for b in plan if len(b) > 1)
    assert "_fast_failed" not in runtime.__dict__  # the fast path answered, no fallback
    assert _worst(batched, alone) <= TOLERANCE
    responses = runtime.systemone_batch(REQUESTS, batch_size=8, batching=settings)
    for response, expected, request in zip(responses, single, REQUESTS, strict=True):
        assert response["usage"] == expected["usage"]  # the caller's order, request by request
        assert response["answers"].keys() == request["questions"].keys()
        for qid, answer in expected["answers"].items():
            for option, p in (answer.get("probabilities") or {"noul": answer.get("noul")}).items():
                got = response["answers"][qid].get("probabilities", {"noul": response["answers"][qid].get("noul")})
                assert got[option] == pytest.approx(p, abs=1e-4 + TOLERANCE)  # 4-decimal rounding


def test_a_request_alone_in_its_batch_is_bit_identical(runtime, fast_on) -> None:
    settings = BatchingSettings(max_rows=8, overhead_tokens=0)  # far lengths: every request alone
    requests = [REQUESTS[1], REQUESTS[3], REQUESTS[8]]
    assert runtime.systemone_batch(requests, batching=settings) == [runtime.systemone(r) for r in requests]
    assert not fast_on


def test_reference_path_batches_agree_too(runtime, monkeypatch) -> None:
    monkeypatch.setenv("BLAZE_FAST", "0")  # the release's own batched forward (transformers, attention mask)
    settings = BatchingSettings(max_rows=8, token_budget=2048, overhead_tokens=64)
    alone = [_probabilities(runtime, [r], settings)[0] for r in REQUESTS]
    assert _worst(_probabilities(runtime, REQUESTS, settings), alone) <= TOLERANCE


def test_bound_detects_a_padding_fault(runtime, fast_on, monkeypatch) -> None:
    """The tolerance can fail: rows whose hidden states are shifted by one position (a padding fault)."""
    settings = BatchingSettings(max_rows=8, token_budget=2048, overhead_tokens=64)
    alone = [_probabilities(runtime, [r], settings)[0] for r in REQUESTS]
    original = GraphedBackbone.rows

    def shifted(self, input_ids, graph_tokens=2048):
        return torch.roll(original(self, input_ids, graph_tokens), 1, dims=1)

    monkeypatch.setattr(GraphedBackbone, "rows", shifted)
    assert _worst(_probabilities(runtime, REQUESTS, settings), alone) > 100 * TOLERANCE
