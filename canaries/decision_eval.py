"""Labelled decision evaluation (`blaze canary … --decisions-eval FILE.jsonl`): base and variant against labels.

Why: the decision canary's |Δp| says how far answers moved, not whether they are still right. On a labelled
set this module measures both models the way clef-finetune's `evaluate` does, plus what moved between them
and how much the same model moves by numerics alone (the noise floor), so drift can be told from rounding.

A record is a SystemOne request (`model`, `state`, `questions`, optional `images`) plus `labels`
({question id: option id}; noul labels may be booleans, score labels level indices), one JSON object a line:
clef-finetune's data format. Image paths are relative to the JSONL file.

Metric definitions are clef-finetune 0.1.0's (`clef_finetune.metrics`), called directly: accuracy, NLL
(−log p of the label, clipped at 1e-12), multiclass Brier (sum over options of (p − onehot)², averaged over
questions), top-label ECE with 10 equal-width bins, and `coverage_at_precision` at 0.99 (the largest share of
questions whose top confidence clears a threshold while precision on them stays ≥ 99 %). macro-F1 is
clef-finetune's per question id (its classes are that question's options), then averaged over question ids,
because one F1 over questions with different option sets is not defined. `mean_confidence` is the mean
probability of the chosen (argmax) option.

The noise floor reruns the *base* through a second numeric path: bfloat16 autocast when the model runs in
float32 (bf16 against float32), else one request per forward pass instead of padded batches (another
kernel path). Its max |Δp| and flips are reported beside the edit's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from clef_model.errors import BlazeError

TARGET_PRECISION = 0.99
REQUEST_KEYS = ("model", "state", "questions", "images", "videos", "id")


@dataclass(frozen=True)
class EvalRecord:
    """One labelled record: its line in the file, the SystemOne request, and labels as option ids."""

    line: int
    request: dict[str, Any]
    labels: dict[str, str]


@dataclass(frozen=True)
class DecisionMetrics:
    """clef-finetune's metrics of one model over every labelled question."""

    questions: int
    accuracy: float
    macro_f1: float
    nll: float
    brier: float
    ece: float
    coverage_at_99: float
    mean_confidence: float


@dataclass(frozen=True)
class NoiseFloor:
    """How far the base's own probabilities move through a second numeric path (no edit involved)."""

    path: str
    max_abs_delta: float
    mean_abs_delta: float
    flips: int


@dataclass(frozen=True)
class QuestionLine:
    """Per question id: chosen-option confidence and accuracy of both models (the card's lines)."""

    question: str
    count: int
    base_confidence: float
    variant_confidence: float
    base_accuracy: float
    variant_accuracy: float

    @property
    def text(self) -> str:
        """e.g. `status: picks at 0.980 mean confidence (vanilla: 0.978); accuracy 1.000 (vanilla: 1.000)`."""
        return (f"{self.question}: picks at {self.variant_confidence:.3f} mean confidence (vanilla: "
                f"{self.base_confidence:.3f}); accuracy {self.variant_accuracy:.3f} (vanilla: "
                f"{self.base_accuracy:.3f}), {self.count} questions")


@dataclass(frozen=True)
class DecisionEvalResult:
    """The `decisions.eval` section of a canary report."""

    source: str
    records: int
    questions: int
    base: DecisionMetrics
    variant: DecisionMetrics
    max_abs_delta: float
    mean_abs_delta: float
    flips: int
    noise_floor: NoiseFloor | None
    per_question: list[QuestionLine] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)  # the first records' lines, in the card's style

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (per-question lines carry their text)."""
        out = asdict(self)
        out["per_question"] = [dict(asdict(line), text=line.text) for line in self.per_question]
        return out


# ---------------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------------
def _label(question: dict[str, Any], label: Any) -> str:
    from clef_finetune.data import normalize_label

    return normalize_label(question, label)


def _check_record(item: Any, where: str, labelled: bool = True) -> EvalRecord:
    from clef_model.runtime import validate_request

    if not isinstance(item, dict):
        raise BlazeError(f"{where}: expected a JSON object (a SystemOne request{' plus labels' if labelled else ''})")
    request = {key: item[key] for key in REQUEST_KEYS if key in item}
    try:
        validate_request(request)
    except ValueError as error:
        raise BlazeError(f"{where}: {error}") from None
    images = request.get("images")
    if images is not None and not isinstance(images, list):
        raise BlazeError(f"{where}: 'images' must be a list")
    if not labelled:  # a request file (`blaze edit --preserve-requests`): labels, if any, are not read
        return EvalRecord(line=0, request=request, labels={})
    labels = item.get("labels")
    if not isinstance(labels, dict) or not labels:
        raise BlazeError(f"{where}: needs 'labels', an object mapping question ids to the right option id")
    normalized = {}
    for qid, label in labels.items():
        if qid not in request["questions"]:
            raise BlazeError(f"{where}: label for unknown question {qid!r} (questions: "
                             f"{', '.join(request['questions'])})")
        try:
            normalized[qid] = _label(request["questions"][qid], label)
        except ValueError as error:
            raise BlazeError(f"{where}: labels.{qid}: {error}") from None
    return EvalRecord(line=int(where.rsplit(":", 1)[1].split()[0]) if ":" in where else 0, request=request,
                      labels=normalized)


def load_eval_file(path: Path, *, labelled: bool = True) -> list[EvalRecord]:
    """Read and check a labelled JSONL file; a bad record raises BlazeError naming `FILE:LINE`.

    ``labelled=False`` reads the same format as plain SystemOne requests (`blaze edit --preserve-requests`):
    `labels` may be absent and is ignored; the records' `labels` are empty."""
    path = Path(path)
    if not path.is_file():
        what = "decision eval file" if labelled else "request file"
        raise BlazeError(f"{what} {path} not found; pass a JSONL file of {'labelled ' if labelled else ''}"
                         "SystemOne requests")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise BlazeError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        record = _check_record(item, where, labelled)
        images = record.request.get("images")
        if images:
            resolved = [entry if not isinstance(entry, str) or entry.startswith(("data:", "http://", "https://"))
                        or Path(entry).is_absolute() else str(path.parent / entry) for entry in images]
            record = EvalRecord(line=number, request=dict(record.request, images=resolved), labels=record.labels)
        else:
            record = EvalRecord(line=number, request=record.request, labels=record.labels)
        records.append(record)
    if not records:
        raise BlazeError(f"{path}: no records; each line must be a {'labelled ' if labelled else ''}SystemOne request")
    return records


# ---------------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------------
Probabilities = list[dict[str, dict[str, float]]]


def probabilities(runtime: Any, records: list[EvalRecord], batch_size: int) -> Probabilities:
    """Unrounded option probabilities of every record (the release's own encoder and head)."""
    requests = [record.request for record in records]
    try:
        return runtime.decision_probabilities(requests, batch_size=batch_size)
    except BlazeError as error:
        raise BlazeError(f"decision eval: {error}") from None


def noise_path(runtime: Any) -> str:
    """Which second numeric path `noise_floor` uses for this runtime."""
    import torch

    if getattr(runtime, "dtype", None) == torch.float32:
        return "bfloat16 autocast vs float32"
    return "one request per forward pass vs padded batches"


def noise_floor(runtime: Any, records: list[EvalRecord], reference: Probabilities, batch_size: int) -> NoiseFloor:
    """Rerun the same (base) model through a second numeric path and compare with `reference`."""
    import torch

    path = noise_path(runtime)
    again = None
    if path.startswith("bfloat16"):
        try:
            with torch.autocast(device_type=runtime.device.type, dtype=torch.bfloat16):
                again = probabilities(runtime, records, batch_size)
        except RuntimeError:  # a kernel without a bf16 autocast path: fall back to the other path
            path = "one request per forward pass vs padded batches"
    if again is None:
        again = probabilities(runtime, records, 1)
    max_delta, mean_delta, flips = _drift(records, reference, again)
    return NoiseFloor(path=path, max_abs_delta=max_delta, mean_abs_delta=mean_delta, flips=flips)


def _argmax(probs: dict[str, float]) -> str:
    return max(probs, key=probs.__getitem__)


def _drift(records: list[EvalRecord], a: Probabilities, b: Probabilities) -> tuple[float, float, int]:
    deltas, flips = [], 0
    for record, pa, pb in zip(records, a, b, strict=True):
        for qid in record.request["questions"]:
            deltas += [abs(pa[qid][option] - pb[qid][option]) for option in pa[qid]]
            flips += _argmax(pa[qid]) != _argmax(pb[qid])
    return max(deltas, default=0.0), sum(deltas) / len(deltas) if deltas else 0.0, flips


def metrics(records: list[EvalRecord], probs: Probabilities) -> DecisionMetrics:
    """clef-finetune's metrics over every labelled question (see the module docstring)."""
    from clef_finetune import metrics as cf

    rows: list[tuple[str, list[float], int]] = []
    for record, record_probs in zip(records, probs, strict=True):
        for qid, label in record.labels.items():
            options = list(record_probs[qid])
            rows.append((qid, [record_probs[qid][o] for o in options], options.index(label)))
    vectors = [p for _, p, _ in rows]
    targets = [t for _, _, t in rows]
    preds = [max(range(len(p)), key=p.__getitem__) for p in vectors]
    by_question: dict[str, list[int]] = {}
    for index, (qid, _, _) in enumerate(rows):
        by_question.setdefault(qid, []).append(index)
    f1s = [cf.macro_f1([preds[i] for i in idx], [targets[i] for i in idx], len(vectors[idx[0]]))
           for idx in by_question.values()]
    confidences = [max(p) for p in vectors]
    coverage = cf.coverage_at_precision(confidences, [p == t for p, t in zip(preds, targets, strict=False)], TARGET_PRECISION)
    return DecisionMetrics(questions=len(rows), accuracy=cf.accuracy(preds, targets),
                           macro_f1=sum(f1s) / len(f1s), nll=cf.nll(vectors, targets),
                           brier=cf.brier_score(vectors, targets), ece=cf.ece(vectors, targets),
                           coverage_at_99=float(coverage["coverage"]),
                           mean_confidence=sum(confidences) / len(confidences))


def _question_lines(records: list[EvalRecord], base: Probabilities, variant: Probabilities) -> list[QuestionLine]:
    stats: dict[str, list[tuple[float, float, bool, bool]]] = {}
    for record, pb, pv in zip(records, base, variant, strict=True):
        for qid, label in record.labels.items():
            b_pick, v_pick = _argmax(pb[qid]), _argmax(pv[qid])
            stats.setdefault(qid, []).append((pb[qid][b_pick], pv[qid][v_pick], b_pick == label, v_pick == label))
    lines = []
    for qid in sorted(stats):
        rows = stats[qid]
        n = len(rows)
        lines.append(QuestionLine(question=qid, count=n, base_confidence=sum(r[0] for r in rows) / n,
                                  variant_confidence=sum(r[1] for r in rows) / n,
                                  base_accuracy=sum(r[2] for r in rows) / n,
                                  variant_accuracy=sum(r[3] for r in rows) / n))
    return lines


def compare(source: str, records: list[EvalRecord], base: Probabilities, variant: Probabilities,
            noise: NoiseFloor | None) -> DecisionEvalResult:
    """The eval section from both models' probabilities (and the base's noise floor)."""
    from canaries.decisions import describe

    max_delta, mean_delta, flips = _drift(records, base, variant)
    examples = []
    for record, pb, pv in list(zip(records, base, variant, strict=False))[:3]:
        name = record.request.get("id", f"line {record.line}")
        examples.append(f"{name}: " + "; ".join(describe(q, qid, pb[qid], pv[qid])
                                                for qid, q in record.request["questions"].items()))
    return DecisionEvalResult(source=source, records=len(records), questions=sum(len(r.labels) for r in records),
                              base=metrics(records, base), variant=metrics(records, variant),
                              max_abs_delta=max_delta, mean_abs_delta=mean_delta, flips=flips, noise_floor=noise,
                              per_question=_question_lines(records, base, variant), examples=examples)


# ---------------------------------------------------------------------------------------------------
# rendering (markdown report and model card read the JSON dict, so a report loaded back renders the same)
# ---------------------------------------------------------------------------------------------------
_ROWS = (("accuracy", "accuracy"), ("macro_f1", "macro-F1"), ("nll", "NLL"), ("brier", "Brier"),
         ("ece", "ECE (10 bins)"), ("coverage_at_99", "auto-decide coverage at 99 % precision"),
         ("mean_confidence", "mean confidence of the chosen option"))


def markdown(section: dict[str, Any] | None, heading: str = "###") -> list[str]:
    """Markdown lines for a `decisions.eval` dict: metrics table, drift beside the noise floor, per-question lines."""
    if not section:
        return []
    out = [f"{heading} Labelled decision evaluation", "",
           f"{section['records']} records, {section['questions']} labelled questions "
           f"(`{Path(str(section['source'])).name}`; clef-finetune's metric definitions).", "",
           "| metric | vanilla | variant |", "|---|---|---|"]
    for key, name in _ROWS:
        out.append(f"| {name} | {section['base'][key]:.4f} | {section['variant'][key]:.4f} |")
    noise = section.get("noise_floor")
    drift = (f"Largest |Δp| over every option of every record: **{section['max_abs_delta']:.4f}** "
             f"(mean {section['mean_abs_delta']:.5f}), chosen options changed: **{section['flips']}**.")
    if noise:
        drift += (f" Noise floor (the base through {noise['path']}): largest |Δp| {noise['max_abs_delta']:.4f}, "
                  f"{noise['flips']} changed.")
    out += ["", drift, ""]
    out += [f"- `{line['text']}`" for line in section.get("per_question", [])]
    if section.get("examples"):
        out += ["", "Examples:", ""] + [f"- `{line}`" for line in section["examples"]]
    out.append("")
    return out


def summary_line(section: dict[str, Any] | None) -> str | None:
    """One terminal line: accuracy and confidence of both models, drift and the noise floor."""
    if not section:
        return None
    noise = section.get("noise_floor")
    floor = f"; noise floor {noise['max_abs_delta']:.4f} ({noise['path']})" if noise else ""
    return (f"decision eval ({section['records']} records): accuracy {section['variant']['accuracy']:.3f} "
            f"(vanilla: {section['base']['accuracy']:.3f}), mean confidence "
            f"{section['variant']['mean_confidence']:.3f} (vanilla: {section['base']['mean_confidence']:.3f}), "
            f"max |Δp| {section['max_abs_delta']:.4f}, flips {section['flips']}{floor}")


def run_eval(path: Path, records: list[EvalRecord], load_base: Any, load_variant: Any, batch_size: int,
             noise: bool = True) -> DecisionEvalResult:
    """Evaluate both models on `records` (from `load_eval_file(path)`); `load_*` return Runtimes (called once).

    The base runs first (and its noise floor), then the variant, so the CLI may load one after the other.
    """
    base_rt = load_base()
    if not getattr(base_rt, "is_clef", False):
        raise BlazeError("--decisions-eval needs Clef releases with a joint decision head; the base is a plain "
                         "causal LM")
    base = probabilities(base_rt, records, batch_size)
    floor = noise_floor(base_rt, records, base, batch_size) if noise else None
    del base_rt
    variant_rt = load_variant()
    if not getattr(variant_rt, "is_clef", False):
        raise BlazeError("--decisions-eval needs Clef releases with a joint decision head; the variant is a plain "
                         "causal LM")
    variant = probabilities(variant_rt, records, batch_size)
    return compare(str(path), records, base, variant, floor)


def card_lines(section: dict[str, Any] | None) -> list[str]:
    """Model-card lines for `decisions.eval` (the card calls this; the section is the report's JSON dict)."""
    return markdown(section, heading="###")
