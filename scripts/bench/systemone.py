"""Section ``systemone``: SystemOne latency, stock path vs blaze's fast paths, and answer agreement.

On the model card's invoice request with its state padded to ~``--s1-tokens`` tokens: the stock release
path, ``Runtime.systemone`` with its fast hooks (the product path; with ``BLAZE_FAST_COMPILE=1`` in the
environment, the compiled backbone), and ``clef_model.fast.FastSystemOne``; median / p95 over
``--s1-repeats`` after ``--s1-warmup``; the time split (encode, backbone, head); answer agreement (max |Δp|
over the invoice and the canary suite's requests). ``--s1-control`` adds the kernel-noise control: the
stock path against itself with SDPA's math kernel, the rounding floor any faster path is judged against.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from clef_model.backbone import text_decoder
from scripts.bench.common import Bench, fast_setting, free_gpu, summary_ms, timed
from scripts.bench.models import Loaded, kernel_report

Answer = Callable[[dict], dict]


def invoice_request(tokenizer: Any, code: Any, target_tokens: int) -> tuple[dict, int]:
    """The model card's invoice request with a `notes` field grown until the prompt is ~target tokens."""
    from canaries.suites import default_decision_suite

    base = next(r for r in default_decision_suite() if "invoice" in r.get("id", ""))
    request = {k: v for k, v in base.items() if k in ("model", "state", "questions")}
    request = json.loads(json.dumps(request))
    line = "Line item: consulting services rendered under the framework agreement, billed monthly. "
    words = 0
    while True:
        request["state"]["invoice"]["notes"] = line * words
        length = len(code.encode_record(tokenizer, request).input_ids)
        if length >= target_tokens or words > 10000:
            return request, length
        words = max(words + 1, int(words * target_tokens / max(length, 1)) if words else 8)


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest difference between two SystemOne answers (probabilities, noul, score; 1.0 if a choice differs)."""
    worst = 0.0
    for qid, want in a["answers"].items():
        got = b["answers"][qid]
        for key in ("noul", "score", "confidence"):
            if key in want:
                worst = max(worst, abs(want[key] - got[key]))
        for option, p in want.get("probabilities", {}).items():
            worst = max(worst, abs(p - got["probabilities"][option]))
        if want.get("choice") != got.get("choice"):
            worst = max(worst, 1.0)
    return worst


def agreement_requests(padded: dict) -> list[dict]:
    """The padded invoice request, then the canary suite's typed-decision requests."""
    from canaries.suites import default_decision_suite

    plain = [{k: v for k, v in r.items() if k in ("model", "state", "questions")} for r in default_decision_suite()]
    return [padded] + plain


def agreement(bench: Bench, request: dict, ref: Answer, other: Answer) -> dict[str, Any]:
    """Max |Δ| between two SystemOne paths over the agreement requests, and how many exceed 1e-3."""
    diffs = [max_abs_diff(ref(r), other(r)) for r in agreement_requests(request)[: bench.options.s1_agree]]
    return {"agreement_max_abs_diff": max(diffs), "requests_over_1e-3": sum(d > 1e-3 for d in diffs),
            "agreement_requests": len(diffs)}


def run(bench: Bench, loaded: Loaded) -> None:
    """Time the stock and fast SystemOne paths on the padded invoice request; record the split and agreement."""
    options = bench.options
    out: dict[str, Any] = {"model": loaded.label, "kernels": kernel_report(loaded.backbone)}
    request, tokens = invoice_request(loaded.tokenizer, loaded.code, options.s1_tokens)
    out["input_tokens"] = tokens
    bench.say(f"systemone: invoice request padded to {tokens} tokens; kernels {out['kernels']}")
    plain_ref = loaded.reference

    def ref(r: dict) -> dict:
        with fast_setting("0"):  # the reference path, also when it is Runtime.systemone (hooks declined)
            return plain_ref(r)

    for _ in range(options.s1_warmup):
        ref(request)
    out["stock"] = summary_ms([timed(lambda: ref(request))[1] for _ in range(options.s1_repeats)])
    bench.say(f"systemone stock: {out['stock']}")
    if loaded.runtime is not None and bench.device == "cuda":
        out.update(_runtime_hooks(bench, loaded, request, ref))
    code, tok = loaded.code, loaded.tokenizer
    encode = [timed(lambda: code.encode_record(tok, request))[1] for _ in range(10)]
    enc = code.encode_record(tok, request)
    batch = code.collate_records([enc], tok.pad_token_id or 0, torch.device(bench.device))
    text = text_decoder(loaded.backbone)
    with torch.inference_mode():
        fwd = [timed(lambda: text(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  use_cache=False))[1] for _ in range(10)]
    out["stock_split"] = {"encode": summary_ms(encode), "backbone": summary_ms(fwd)}

    _fast_path(bench, loaded, request, tokens, enc, batch, ref, out)
    bench.results.systemone = out
    free_gpu()


def _fast_path(bench: Bench, loaded: Loaded, request: dict, tokens: int, enc: Any, batch: dict, ref: Answer,
               out: dict[str, Any]) -> None:
    """``FastSystemOne`` (graphed backbone + release head) into ``out``: capture, latency, split, agreement,
    and with ``--s1-control`` the kernel-noise control. A failure is recorded and the run goes on."""
    from clef_model.fast import FastSystemOne

    options = bench.options
    fast = FastSystemOne(loaded.backbone, loaded.head, loaded.tokenizer, loaded.code, ref)
    out["fast_uses_fla"] = fast.engine.uses_fla
    try:
        _, capture = timed(lambda: fast.backbone.warm([tokens]))
        out["graph_capture_s"] = round(capture, 2)
        for _ in range(options.s1_warmup):
            fast(request)
        out["fast"] = summary_ms([timed(lambda: fast(request))[1] for _ in range(options.s1_repeats)])
        out["fast_split"] = _fast_split(fast, loaded, enc, batch, tokens, min(20, options.s1_repeats))
        diffs = [max_abs_diff(ref(r), fast(r)) for r in agreement_requests(request)[: options.s1_agree]]
        out["agreement_max_abs_diff"] = max(diffs)
        out["agreement_requests"] = len(diffs)
        bench.say(f"systemone fast: {out['fast']} split {out['fast_split']} max|dp| {out['agreement_max_abs_diff']}")
        if options.s1_control:
            out["control_sdpa_math"] = control_sdpa_math(bench, loaded, request, batch, ref)
    except Exception:  # noqa: BLE001 - record and go on with the other figures
        out["fast_error"] = bench.failed("systemone fast")


def _runtime_hooks(bench: Bench, loaded: Loaded, request: dict, ref: Answer) -> dict[str, Any]:
    """The product path: ``Runtime.systemone`` with its fast hooks (``BLAZE_FAST`` unset, i.e. the default)."""
    plain_ref = loaded.reference
    out: dict[str, Any] = {}
    try:
        with fast_setting(None):
            for _ in range(bench.options.s1_warmup):
                plain_ref(request)
            hooked = [timed(lambda: plain_ref(request))[1] for _ in range(bench.options.s1_repeats)]
            out["runtime_fast"] = summary_ms(hooked)
            out["runtime_fast_agreement"] = max_abs_diff(ref(request), plain_ref(request))
            out["runtime_fast_failed"] = loaded.runtime.__dict__.get("_fast_failed")
        bench.say(f"systemone Runtime.systemone (fast hooks): {out['runtime_fast']}")
    except Exception:  # noqa: BLE001 - record and go on with the other figures
        out["runtime_fast_error"] = bench.failed("Runtime fast hook")
    return out


@torch.inference_mode()
def _fast_split(fast: Any, loaded: Loaded, enc: Any, batch: dict, tokens: int, reps: int) -> dict[str, Any]:
    """Where a fast request's time goes: backbone graph replay vs the same engine eager, and the two heads."""
    from clef_model.fast import head_logits, head_plan

    ids = batch["input_ids"]
    replay = [timed(lambda: fast.backbone(ids))[1] for _ in range(reps)]
    eager = [timed(lambda: fast.engine.hidden_states(ids))[1] for _ in range(reps)]
    hidden = fast.backbone(ids)
    weight = fast.engine.lm_head.weight
    head = [timed(lambda: loaded.head(hidden, ids, batch["attention_mask"], batch["records"], weight))[1]
            for _ in range(reps)]
    vhead = [timed(lambda: head_logits(loaded.head, hidden[0], head_plan(enc, fast.engine.device), weight))[1]
             for _ in range(reps)]
    return {"backbone_graph": summary_ms(replay), "backbone_engine_eager": summary_ms(eager),
            "head_release": summary_ms(head), "head_vectorised": summary_ms(vhead),
            "bucket": fast.backbone.bucket_for(tokens), "vector_head": fast.vector_head}


def control_sdpa_math(bench: Bench, loaded: Loaded, request: dict, batch: dict, ref: Answer) -> dict[str, Any]:
    """Control: the stock reference path itself, with full attention forced to SDPA's math kernel.

    Both are legitimate transformers forwards that differ only in rounding. How far their answers and hidden
    states move apart shows how much this model amplifies rounding differences: the floor for any
    comparison of a faster path against the reference on it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def math_ref(r: dict) -> dict:
        with sdpa_kernel([SDPBackend.MATH]):
            return ref(r)

    result: dict[str, Any] = {}
    try:
        text = text_decoder(loaded.backbone)
        with torch.inference_mode():
            reference = text(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.float()
            with sdpa_kernel([SDPBackend.MATH]):
                other = text(input_ids=batch["input_ids"], use_cache=False).last_hidden_state.float()
        result["rel_error_vs_default_sdpa"] = round(float((other - reference).norm() / reference.norm()), 5)
        result.update(agreement(bench, request, ref, math_ref))
    except Exception:  # noqa: BLE001 - a control: record and go on
        result["error"] = bench.failed("control")
    bench.say(f"systemone control (stock, SDPA math vs default): {result}")
    return result
