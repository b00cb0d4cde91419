"""Typed-decision canaries: both models' probabilities for every option of every SystemOne question.

Summary figures: largest and mean |Δp| over all options of all questions, argmax flips, and per-request lines in
the model card's style (`status: picks overdue at 0.980 confidence (vanilla: 0.978)`). Requests that carry
`labels` (question id → correct option) add accuracy, top-label ECE (15 equal-width bins) and multiclass Brier
score (sum over options of (p − onehot)², averaged over questions) for both models.
"""

from __future__ import annotations

from typing import Any

ECE_BINS = 15
NOT_APPLICABLE = "does not apply: the base is a plain causal LM without a joint decision head"


def option_order(question: dict[str, Any]) -> list[str]:
    """Option ids in the release's order: noul true/false, choice keys sorted, score "0".."n-1"."""
    kind = question["type"]
    if kind == "noul":
        return ["true", "false"]
    if kind == "choice":
        return sorted(str(key) for key in question["criteria"])
    return [str(index) for index in range(len(question["criteria"]))]


def normalize_label(question: dict[str, Any], label: Any) -> str:
    """Labels as option ids: booleans for noul become "true"/"false", score levels become their index."""
    if question["type"] == "noul" and isinstance(label, bool):
        return "true" if label else "false"
    return str(label)


def _argmax(probabilities: dict[str, float], order: list[str]) -> str:
    return max(order, key=lambda option: probabilities.get(option, 0.0))


def _expected_score(probabilities: dict[str, float], order: list[str]) -> float:
    return sum(index * probabilities.get(level, 0.0) for index, level in enumerate(order))


def describe(question: dict[str, Any], qid: str, base: dict[str, float], variant: dict[str, float]) -> str:
    """One model-card line for a question, vanilla (base) value in brackets."""
    order = option_order(question)
    if question["type"] == "noul":
        return f"{qid}: p(true) {variant['true']:.3f} (vanilla: {base['true']:.3f})"
    if question["type"] == "score":
        return (f"{qid}: expected score {_expected_score(variant, order):.3f} of {len(order) - 1} "
                f"(vanilla: {_expected_score(base, order):.3f})")
    pick, base_pick = _argmax(variant, order), _argmax(base, order)
    line = f"{qid}: picks {pick} at {variant[pick]:.3f} confidence (vanilla: {base[base_pick]:.3f}"
    return line + (")" if pick == base_pick else f", picked {base_pick})")


def calibration(records: list[tuple[dict[str, float], list[str], str]]) -> dict[str, Any]:
    """Accuracy, top-label ECE (15 bins) and multiclass Brier over (probabilities, options, label) records."""
    if not records:
        return {"labelled_questions": 0, "accuracy": None, "ece": None, "brier": None}
    bins: list[list[tuple[float, bool]]] = [[] for _ in range(ECE_BINS)]
    correct = 0
    brier = 0.0
    for probabilities, order, label in records:
        pick = _argmax(probabilities, order)
        confidence = probabilities[pick]
        hit = pick == label
        correct += hit
        bins[min(ECE_BINS - 1, int(confidence * ECE_BINS))].append((confidence, hit))
        brier += sum((probabilities.get(option, 0.0) - (option == label)) ** 2 for option in order)
    n = len(records)
    ece = sum(abs(sum(c for c, _ in b) / len(b) - sum(h for _, h in b) / len(b)) * len(b) / n for b in bins if b)
    return {"labelled_questions": n, "accuracy": correct / n, "ece": ece, "brier": brier / n}


def compare_decisions(items: list[dict[str, Any]], base: list[dict[str, dict[str, float]]],
                      variant: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """The decisions section: per request and question both models' probabilities, picks, |Δp| and lines."""
    requests = []
    deltas: list[float] = []
    flips = 0
    labelled: dict[str, list] = {"base": [], "variant": []}
    for index, (item, base_probs, var_probs) in enumerate(zip(items, base, variant, strict=True)):
        questions_out = {}
        lines = []
        for qid, question in item["questions"].items():
            order = option_order(question)
            b, v = base_probs[qid], var_probs[qid]
            question_deltas = [abs(v.get(o, 0.0) - b.get(o, 0.0)) for o in order]
            deltas.extend(question_deltas)
            b_pick, v_pick = _argmax(b, order), _argmax(v, order)
            flips += b_pick != v_pick
            label = item.get("labels", {}).get(qid)
            entry = {
                "type": question["type"],
                "options": order,
                "base": {"probabilities": {o: b.get(o, 0.0) for o in order}, "choice": b_pick, "confidence": b[b_pick]},
                "variant": {"probabilities": {o: v.get(o, 0.0) for o in order}, "choice": v_pick,
                            "confidence": v[v_pick]},
                "max_abs_delta": max(question_deltas),
                "flipped": b_pick != v_pick,
                "line": describe(question, qid, b, v),
            }
            if question["type"] == "score":
                entry["base"]["expected_score"] = _expected_score(b, order)
                entry["variant"]["expected_score"] = _expected_score(v, order)
            if label is not None:
                label = normalize_label(question, label)
                entry["label"] = label
                labelled["base"].append((b, order, label))
                labelled["variant"].append((v, order, label))
            questions_out[qid] = entry
            lines.append(entry["line"])
        requests.append({"id": item.get("id", f"request-{index}"), "image": bool(item.get("images")),
                         "questions": questions_out, "lines": lines})
    return {
        "applicable": True,
        "requests": requests,
        "summary": {
            "requests": len(requests),
            "questions": sum(len(r["questions"]) for r in requests),
            "max_abs_delta": max(deltas, default=0.0),
            "mean_abs_delta": sum(deltas) / len(deltas) if deltas else 0.0,
            "argmax_flips": flips,
            "calibration": {"base": calibration(labelled["base"]), "variant": calibration(labelled["variant"])},
        },
    }


def not_applicable() -> dict[str, Any]:
    """The decisions section for plain causal LMs."""
    return {"applicable": False, "reason": NOT_APPLICABLE, "requests": [], "summary": None}
