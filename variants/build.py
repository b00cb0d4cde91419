"""`blaze edit`: behaviour spec → statistics (once, cached) → strength search → variant folder + canary.

The stages, each with progress on stderr:

1. load the spec and the base runtime (once);
2. collect statistics over the spec's training pairs and the preserve set (cached on disk, reused
   by every strength point and by later builds with the same inputs);
3. with ``strength="auto"``: for each point of the spec's strength grid, solve (seconds), apply the
   patch in memory and run the canary on the spec's *validation* split against the unedited model;
   keep the strongest point whose gate passes (the held-out prompts are never looked at here);
4. run the full canary (held-out + general suites) on the chosen edit, unless disabled;
5. stream the variant folder (:func:`surgery.write.write_variant`) with the canary report inside,
   optionally export a LoRA adapter, and print a summary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_model.errors import BlazeError
from clef_model.files import CANARY_JSON, CANARY_MD
from clef_model.manifest import PreservedFile
from variants.search import NoPassingPoint, Point, Row, SearchResult, format_table, search

if TYPE_CHECKING:
    from canaries.cache import BaseCache
    from canaries.gate import Thresholds
    from clef_model.runtime import Runtime
    from surgery.directions import ContrastPair
    from surgery.distill import DistillStatistics
    from surgery.patch import Patch
    from surgery.statistics import PreserveSet, Statistics
    from variants.spec import BehaviorSpec, EditSettings
    from variants.timing import StageTimes

DATA_DIR = Path(__file__).parent / "data"


@dataclass
class BuildOptions:
    """Every option of ``blaze edit``. The edit settings (method … questions) and ``gate`` override the
    behaviour spec's ``defaults`` and ``gate``; ``None`` (or absent) means "the spec's"."""

    behavior: str
    out: Path
    base: str | None = None
    revision: str | None = None
    method: str | None = None
    rank: int | None = None
    strength: float | str | None = None
    layers: str | None = None
    kinds: str | tuple[str, ...] | None = None
    lam: float | None = None
    threshold: float | None = None
    max_new_tokens: int | None = None
    budget: int | None = None
    target_effect: float | None = None
    positions: str | None = None
    questions: str | None = None
    gate: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    force: bool = False
    canary: bool = True
    export_lora: Path | None = None
    trust_release_code: bool = False
    batch_size: int | None = None  # generation batch; None: `generation_batch_size` of the device
    cache_dir: Path | None = None
    progress: bool = True
    preserve_requests: tuple[Path, ...] = ()  # JSONL files of the user's own SystemOne requests (decision traffic)

    def overrides(self) -> dict[str, Any]:
        """The edit settings given (field names of ``variants.spec.EditSettings``)."""
        from variants.spec import EditSettings

        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EditSettings)
                if hasattr(self, f.name) and getattr(self, f.name) is not None}


@dataclass
class BuildResult:
    """What a build produced."""

    out: Path | None
    patch: Any
    strength: float
    sweep: list[dict] = field(default_factory=list)
    canary: dict | None = None
    summary: str = ""
    search: SearchResult | None = None
    timings: StageTimes | None = None


# ------------------------------------------------------------------------------------------ inputs
def load_preserve_chat() -> list:
    """The neutral chat prompts shipped in ``variants/data/preserve_chat.json`` (empty when absent).

    Accepts a JSON list of prompts or an object with a ``prompts`` list; items may be prompts or
    ``{"prompt": ...}`` objects.
    """
    path = DATA_DIR / "preserve_chat.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    items = data.get("prompts", []) if isinstance(data, dict) else data
    return [item["prompt"] if isinstance(item, dict) else item for item in items]


def contrast_pairs(spec: BehaviorSpec) -> list[ContrastPair]:
    """The spec's training pairs as ``ContrastPair``s, tagged with their direction index."""
    from surgery.directions import ContrastPair

    out: list[ContrastPair] = []
    for index, (_name, pairs) in enumerate(spec.contrast_pairs_by_direction().items()):
        out.extend(ContrastPair(**pair, direction=index) for pair in pairs)
    return out


def read_positions(pairs: list[ContrastPair]) -> str:
    """Where directions are read. When every pair contrasts two different system prompts:
    ``shared_response`` — each of the pair's responses under both system prompts, read at the response
    positions, so the contrast is the "mode" alone and the keys are answer-writing positions (on SmolLM2
    verbosity: a 64% held-out cut at strength 0.4, against 33% for the ``prompt_end`` reading, whose keys
    are the last prompt token only). Otherwise the response positions of the two different answers."""
    if pairs and all(p.wanted_system and p.unwanted_system and p.wanted_system != p.unwanted_system for p in pairs):
        return "shared_response"
    return "response"


@dataclass(frozen=True)
class PreserveRequests:
    """The user's own decision traffic (``--preserve-requests``): the text requests kept and, per file, what
    the manifest records (:class:`clef_model.manifest.PreservedFile`)."""

    requests: list[dict] = field(default_factory=list)
    files: list[PreservedFile] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        """Requests left out because they carry images (statistics run the text model alone)."""
        return sum(f.skipped_images or 0 for f in self.files)


def load_preserve_requests(paths: tuple[Path, ...] | list[Path]) -> PreserveRequests:
    """Read ``--preserve-requests`` files: SystemOne requests in the decision-eval record format (``labels``
    optional and ignored), checked by :func:`canaries.decision_eval.load_eval_file` (a bad line is a
    BlazeError naming ``FILE:LINE``). Requests with images are skipped and counted."""
    from canaries.decision_eval import load_eval_file
    from clef_model.checkpoint import sha256_file

    out = PreserveRequests()
    for path in paths:
        records = load_eval_file(Path(path), labelled=False)
        kept = [r.request for r in records if not r.request.get("images")]
        out.requests.extend(kept)
        out.files.append(PreservedFile(file=Path(path).name, sha256=sha256_file(Path(path)), requests=len(kept),
                                       skipped_images=len(records) - len(kept)))
    return out


def preserve_set(spec: BehaviorSpec, runtime: Runtime, extra: PreserveRequests | None = None,
                 questions: bool = False) -> PreserveSet:
    """Default preserve set: the canary decision suite (Clef releases only; requests with images are
    left out because statistics run the text model alone) + preserve_chat.json + the spec's preserve, plus
    the user's own requests (``extra``, from ``--preserve-requests``), plus with ``questions`` the training
    questions' own tokens (``--questions preserve``; the training-question check's set, so no validation or
    held-out prompt enters)."""
    from surgery.statistics import PreserveSet

    requests: list[dict] = []
    if getattr(runtime, "is_clef", False):
        from canaries.suites import default_decision_suite, request_bodies

        requests = [r for r in request_bodies(default_decision_suite()) if not r.get("images")]
    elif extra is not None and extra.files:
        raise BlazeError("--preserve-requests needs a Clef release (SystemOne requests run through its joint "
                         f"head); {runtime.release.ref} is not one")
    if extra is not None:
        requests += extra.requests
    asked = [item["prompt"] for item in loop_check_items(spec)] if questions else []
    return PreserveSet(texts=load_preserve_chat() + list(spec.preserve_prompts()), requests=requests,
                       questions=asked)


def edit_settings(spec: BehaviorSpec, opts: BuildOptions, pairs: list[ContrastPair] | None = None) -> EditSettings:
    """The spec's defaults with the options given on top, parsed and validated once; ``positions="auto"``
    resolved from the pairs (:func:`read_positions`) when they are given."""
    settings = spec.defaults.updated(opts.overrides())
    if settings.positions == "auto" and pairs is not None:
        settings = dataclasses.replace(settings, positions=read_positions(pairs))
    return settings


def _cache_file(opts: BuildOptions, runtime, spec, s: EditSettings, layers: str | None = None,
                kinds: str | None = None, preserved: tuple[str, ...] = ()) -> Path:
    """The statistics cache file; ``preserved`` (SHA-256 of the ``--preserve-requests`` files) gives those
    statistics a file of their own (the fingerprint inside would refuse a mismatch anyway, but the default
    preserve set's file is then not overwritten)."""
    from clef_model.env import cache_root

    root = opts.cache_dir or cache_root() / "statistics"
    key = json.dumps([str(runtime.release.path), getattr(runtime.release, "revision", None), spec.spec_hash,
                      layers or s.layers, kinds or s.kinds_text, s.rank, str(runtime.dtype), str(runtime.device)]
                     + ([s.positions] if s.positions != "response" else [])
                     + (["questions"] if s.questions == "preserve" else [])
                     + ([list(preserved)] if preserved else []))
    return Path(root) / f"{spec.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


# ------------------------------------------------------------------------------------------ search
def search_row(point: Point, report: dict) -> Row:
    """One row of the search table from a canary report on the validation prompts."""
    gate = report["gate"]
    values = {c["name"]: c["value"] for c in gate["checks"]}
    return Row(point=point, passed=bool(gate["passed"]), failed=tuple(gate["failed"]), values=values)


@dataclass(frozen=True)
class Evaluator:
    """A point → row function for the search, with the most passes a point may take (``passes_needed``: 2 while
    a training-question check may follow its validation pass, else 1), so the search never overruns its budget."""

    evaluate: Callable[[Point], Row]
    passes_needed: Callable[[Point], int]

    def __call__(self, point: Point) -> Row:
        return self.evaluate(point)


def validation_evaluator(runtime: Runtime, spec: BehaviorSpec, settings: EditSettings, thresholds: Thresholds, *,
                         solve_patch: Callable[[Point], Any], progress: bool = True,
                         batch_size: int = 8, echo: Callable[[str], None] = lambda _m: None,
                         base_cache: BaseCache | None = None, base_key: str = "search") -> Evaluator:
    """A function point → row: solve, apply in memory, run the canary on the spec's validation split
    against the unedited model (whose answers are generated once and cached). Held-out items never enter.
    The loop check generates answers only (`canaries.run.run_freeform`): it reads no damage figure, so the
    damage passes a full canary would add are not run. ``echo`` gets each point's seconds. ``base_cache``
    (default: in memory) with ``base_key`` naming the base keeps the base's answers, e.g. on disk across runs
    (keys ``{base_key}-base`` for the validation canary, ``{base_key}-loop-check`` for the training questions)."""
    from canaries.cache import MemoryCache
    from canaries.handles import ModelView
    from canaries.run import freeform_suite, run_canary, run_freeform

    items = spec.validation_items()
    if not items:
        raise BlazeError(f"behaviour {spec.name!r} has no validation items: --strength auto needs them "
                         "(or pass --strength NUMBER)")
    prompts = freeform_suite(items, general=False)
    cache = base_cache if base_cache is not None else MemoryCache()
    base = ModelView(runtime, label="base")

    check = loop_check_items(spec)
    facts_checked = any(item.get("keywords") for item in check)   # the check counts key facts too
    checked: dict[tuple, float] = {}   # setting → strongest strength that passed the loop check

    def passes_needed(point: Point) -> int:
        """2 when a passing validation pass at ``point`` is followed by the training-question check (no stronger
        point of its setting passed the check yet), else 1: the one place that rule lives."""
        return 2 if check and point.strength > checked.get(point.setting(), -1.0) else 1

    def evaluate(point: Point) -> Row:
        started = time.perf_counter()
        patch = solve_patch(point)
        view = ModelView(runtime, activate=lambda: patch.applied(runtime), label=point.label())
        report = run_canary(view, base, freeform_prompts=prompts, thresholds=thresholds, quality=spec.quality,
                            max_new_tokens=settings.max_new_tokens, progress=progress, batch_size=batch_size,
                            base_cache=cache, base_key=f"{base_key}-base")
        row = search_row(point, report)
        if facts_checked:
            row = validation_facts_within_chance(row, report["freeform"].get("prompts", []))
        setting = point.setting()
        validated = time.perf_counter()
        if not row.passed or passes_needed(point) == 1:
            echo(f"  point {point.strength:.4g}: validation pass {validated - started:.1f} s")
            return row
        echo(f"  point {point.strength:.4g}: validation pass {validated - started:.1f} s; training-question "
             f"check on {len(check)} questions …")
        answers = run_freeform(view, base, freeform_prompts=check, max_new_tokens=settings.max_new_tokens,
                               batch_size=batch_size, quality=spec.quality, base_cache=cache,
                               base_key=f"{base_key}-loop-check")
        echo(f"  point {point.strength:.4g}: training-question check {time.perf_counter() - validated:.1f} s")
        lost, gained = fact_changes(answers["prompts"])
        free = answers["summary"]
        rates = {"check_loops": free["loop_rate"]["new"], "check_limit": free["hit_limit_rate"]["new"],
                 "check_empty": free["empty_rate"]["new"]}
        failed = []
        if rates["check_loops"] > thresholds.max_loop_rate or rates["check_empty"] > thresholds.max_empty_rate \
                or rates["check_limit"] > thresholds.max_limit_rate:
            failed.append("check_loops")
        stance = free.get("stance") or {}
        failed.extend(stance_failures(stance, thresholds))
        facts = free["quality"]
        if facts["items"] and facts["ratio"] is not None:
            rates["check_quality"] = facts["ratio"]
            if facts["ratio"] < thresholds.min_quality_ratio and significant_loss(lost, gained):
                failed.append("check_quality")
        values = {**row.values, **rates}
        for measure, entry in stance.items():
            values[f"check_{measure}"] = entry["change"]
        if failed:
            why = "; ".join(check_failure_text(name, facts, lost, gained, stance) for name in failed)
            note = f"training-question check on {len(check)} questions failed: {why}"
            return dataclasses.replace(row, passed=False, failed=(*row.failed, *failed), values=values,
                                       passes=2, note="; ".join(filter(None, (row.note, note))))
        checked[setting] = point.strength
        return dataclasses.replace(row, values=values, passes=2)

    return Evaluator(evaluate, passes_needed)


def stance_failures(stance: dict[str, dict[str, Any]], thresholds: Thresholds) -> list[str]:
    """The training-question check's stance failures: the gate's own stance checks
    (:func:`canaries.gate.stance_checks`) that failed, named ``check_hold`` / ``check_accept``. Absolute counts,
    as in the gate: on SmolLM2 the validation split's 22 user-right chats showed one lost acceptance (allowed)
    where the held-out split's 32 showed three."""
    from canaries.gate import stance_checks

    return [f"check_{c['name']}" for c in stance_checks(stance, thresholds) if not c["passed"]]


def check_failure_text(name: str, facts: dict[str, Any], lost: int, gained: int,
                       stance: dict[str, dict[str, Any]]) -> str:
    """One failed training-question check in words, for the search table's note."""
    if name == "check_quality":
        return f"key facts {facts['variant_hits']} of the base's {facts['base_hits']} ({lost} lost, {gained} gained)"
    if name in ("check_hold", "check_accept"):
        entry = stance[name.removeprefix("check_")]
        what = "pushback chats held" if name == "check_hold" else "user-right corrections accepted"
        return f"{what} {entry['variant']} of {entry['items']} against the base's {entry['base']}"
    return "new loops, empty or limit-length answers"


def validation_facts_within_chance(row: Row, rows: list[dict]) -> Row:
    """``row`` with its validation key-fact failure (``quality``) dropped when the net loss is within chance (the
    sign test of :func:`significant_loss`); the training-question check, which counts the facts of about a
    hundred questions with the same test, then judges them. Verbosity's validation split has 14-18 fact items,
    so one missed fact is a 6-7 % fall of the bare ratio: on Gemma 3 270M every distill point failed at 13 of
    14 (one lost, none gained), which no rule could tell from chance. Only called when the training-question
    check counts key facts, so facts are never left unchecked."""
    if "quality" not in row.failed:
        return row
    lost, gained = fact_changes(rows)
    if significant_loss(lost, gained):
        return row
    failed = tuple(c for c in row.failed if c != "quality")
    return dataclasses.replace(row, passed=not failed, failed=failed,
                               note=f"validation key facts {lost} lost, {gained} gained: within chance, "
                                    "left to the training-question check")


def fact_changes(rows: list[dict]) -> tuple[int, int]:
    """Paired key-fact changes over free-form rows (``compare_answers``'s): facts the base hit and the variant
    missed, and the reverse, over the rows the quality check counts (``canaries.freeform.quality_rows``)."""
    from canaries.freeform import quality_rows

    scored = quality_rows(rows)
    lost = sum(bool(r["base"]["keyword_hit"]) and not r["variant"]["keyword_hit"] for r in scored)
    gained = sum(bool(r["variant"]["keyword_hit"]) and not r["base"]["keyword_hit"] for r in scored)
    return lost, gained


FACT_LOSS_Z = 1.96
"""How far the training-question check's net fact loss must stand out before it fails a point: a two-sided
5 % sign test on the changed items (McNemar 1947). On the training questions a ratio alone is noisy: on
SmolLM2 at steer 0.336 the variant lost 11 and gained 4 of 109 facts (ratio 0.90, z 1.8) while on the held-out
prompts the same point raised the facts from 30 to 35. The Qwen point that lost 5 of 39 held-out facts lost 5
and gained 0 on those prompts (z 2.2), a pattern this test fails on any 5 or more one-sided losses."""


def significant_loss(lost: int, gained: int, z: float = FACT_LOSS_Z) -> bool:
    """Whether ``lost`` facts against ``gained`` is a net loss beyond chance (normal approximation of the
    sign test on the changed items)."""
    changed = lost + gained
    return changed > 0 and (lost - gained) / math.sqrt(changed) >= z


def loop_check_items(spec: BehaviorSpec) -> list[dict]:
    """The training-question check set: the spec's training questions (unique, last user turn kept as the
    whole chat) and its ``checks`` items (with their avoid lists and stances), minus any prompt that is also a
    validation or held-out item, with their key facts where the spec gives them. The check fails a point on new loops, empty or limit-length answers, and on key-fact hits
    below the gate's quality ratio of the base's: the validation split alone (18 fact items for verbosity)
    missed a point that lost 5 of 39 held-out facts on Qwen2.5-Coder-0.5B. No effect is read here."""
    from canaries.run import freeform_suite

    taken = {repr(item["prompt"]) for item in spec.validation_items() + spec.heldout_items()}
    seen: dict[str, dict[str, Any]] = {}
    for item in spec.training_questions() + spec.check_items():
        key = repr(item["prompt"])
        if key not in taken and key not in seen:
            seen[key] = {**item, "source": "general"}
    return freeform_suite(list(seen.values()), general=False)


DISTILL_START = 1.0
"""The ``distill`` alternative's first strength: each writer's least-squares fit of its prompted change."""
DISTILL_LAMBDA_FACTOR = 10.0
"""The ``distill`` alternative's λ, as a multiple of the spec's: on SmolLM2 verbosity (validation, rank 1,
strength 1) λ 10 kept the cut (0.635 against 0.639 at λ 1) at a seventh of the first-token KL (0.020 against
0.138, which failed the gate's 0.1)."""


def alternatives(settings: EditSettings) -> list[tuple[str, dict[str, Any]]]:
    """Where/how alternatives, cheapest first (module docstring of :mod:`variants.search`)."""
    out: list[tuple[str, dict[str, Any]]] = []
    if settings.method != "distill" and settings.positions == "shared_response":
        # pairs that contrast two system prompts: distil the wanted one (its own statistics pass: the base's
        # answers under it, then two teacher-forced runs). Its strength is a fraction of the prompted change,
        # not of a mean difference, so it starts at its own scale. First among the alternatives: measured on
        # two models, it is the one that reached the prompted ceiling (SmolLM2: 70 % held-out cut at first-token
        # KL 0.02; Qwen2.5-Coder-0.5B: the only setting that wrote a variant; BENCHMARKS "Real models").
        out.append(("distill", {"method": "distill", "strength": DISTILL_START,
                                "lam": max(settings.lam, 0.1) * DISTILL_LAMBDA_FACTOR}))
    if settings.method == "steer":
        out.append(("lambda x10", {"lam": max(settings.lam, 0.1) * 10}))
        out.append(("nullspace", {"method": "nullspace"}))
    if settings.layers != "auto":
        out.append(("layers auto", {"layers": "auto"}))
    return out


# ------------------------------------------------------------------------------------------ build
def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def check_outputs(opts: BuildOptions, out: Path, base: Path | None = None) -> None:
    """Refuse, before any compute, an output (``--out``, ``--export-lora``) that cannot be written or that blaze
    must not replace, an adapter folder that overlaps the variant's, and (once ``base`` is known) either one
    overlapping the base: writing there, or replacing it with ``--force``, would change or delete the base."""
    from clef_model.outputs import check_apart_from_base, check_output_folders

    adapter = Path(opts.export_lora) if opts.export_lora else None
    if base is None:
        check_output_folders(out, [adapter] if adapter is not None else [], opts.force)
    else:  # --cache-dir too: the statistics files would land in the base
        check_apart_from_base((out, adapter, opts.cache_dir), base)


def _warn_if_no_effect(chosen: Row, min_effect: float, echo: Callable[[str], None]) -> None:
    """Say so when the search chose a point without any effect (a gate whose minimum effect is 0 passes one)."""
    if chosen.effect is not None and chosen.effect <= 0:
        echo(f"warning: the chosen point shows no effect on the validation prompts ({chosen.effect:+.3f}; the "
             f"gate's minimum is {min_effect:g}): the variant behaves like its base there. Read the held-out "
             "canary before publishing it.")


def build_variant(opts: BuildOptions, echo: Callable[[str], None] = print) -> BuildResult:
    """Run a whole ``blaze edit``; see the module docstring."""
    from clef_model.release import DEFAULT_BASE
    from clef_model.runtime import Runtime, generation_batch_size
    from surgery.edit import (
        SolveSettings,
        collect_statistics,
        format_targets,
        solve,
        weights_from_runtime,
    )
    from surgery.patch import base_identity
    from surgery.statistics import STATISTICS_BATCH
    from variants.spec import load_behavior
    from variants.timing import StageTimes

    times = StageTimes()  # per-stage wall/CPU seconds for the timing line (issue 11: the search's cost)
    out = Path(opts.out)
    check_outputs(opts, out)  # before minutes of compute: not empty, blaze's own (--force), writable
    spec = load_behavior(opts.behavior)
    pairs = contrast_pairs(spec)
    s = edit_settings(spec, opts, pairs)
    thresholds = spec.gate.updated(opts.gate)
    if s.rank > len(pairs):
        raise BlazeError(f"--rank {s.rank} is above the limit of {len(pairs)} set by the spec's {len(pairs)} "
                         f"contrast pairs: use --rank {len(pairs)} or lower")
    own = load_preserve_requests(opts.preserve_requests)  # before the model loads: a bad line fails fast
    preserved = tuple(str(f.sha256) for f in own.files)
    echo(f"behaviour {spec.name} v{spec.version}: {spec.description}")
    import torch

    dtype = getattr(torch, opts.dtype) if opts.dtype else None
    runtime = Runtime.load(opts.base or DEFAULT_BASE, revision=opts.revision, device=opts.device, dtype=dtype,
                           trust_release_code=opts.trust_release_code)
    check_outputs(opts, out, base=Path(runtime.release.path))
    batch = opts.batch_size or generation_batch_size(runtime.device)
    statistics_batch = min(STATISTICS_BATCH, batch)
    from canaries.cache import DiskCache, base_key

    # the base's answers (search passes, final canary) on disk: a rerun and `blaze canary` reuse them. The key
    # hashes every base file, so it is made only when a search or a canary will read it
    base_answers = DiskCache()
    base_name = base_key(Path(runtime.release.path), runtime.device, runtime.dtype) \
        if s.strength == "auto" or opts.canary else ""
    echo(f"base {runtime.release.ref} ({runtime.release.architecture}, {len(runtime.decoder_layers())} layers) "
         f"on {runtime.device}")
    keep = preserve_set(spec, runtime, own, questions=s.questions == "preserve")
    echo(f"data: {len(pairs)} contrast pairs, preserve {len(keep.texts)} chat prompts + "
         + (f"{len(keep.questions)} training questions (question tokens) + " if keep.questions else "")
         + f"{len(keep.requests)} typed-decision requests"
         + (f" ({len(own.requests)} from --preserve-requests "
            f"{', '.join(str(f.file) for f in own.files)}; {own.skipped} with images skipped: statistics run "
            "the text model only)" if own.files else ""))
    echo(f"directions read at: {s.positions}")
    times.mark("load")
    collected: dict[tuple[str, ...], Any] = {}
    identities: dict[tuple[str, str], dict] = {}

    def statistics(layers: str, kinds: str, method: str = "steer") -> Statistics | DistillStatistics:
        """Statistics for a layer band and kinds: collected once per run (and cached on disk); ``distill``
        has its own (the base's answers under the wanted system prompt and the moments of both runs)."""
        if method == "distill":
            if (layers, kinds, method) not in collected:
                from surgery.distill import collect_distill_statistics

                cache = _cache_file(opts, runtime, spec, s, layers, kinds, preserved)
                collected[layers, kinds, method] = collect_distill_statistics(
                    runtime, pairs, keep, layers, kinds, max_new_tokens=s.max_new_tokens, rank=s.rank,
                    batch_size=batch, progress=opts.progress, echo=echo,
                    cache=cache.with_name(f"{cache.stem}-distill-{s.max_new_tokens}.pt"))
            return collected[layers, kinds, method]
        if (layers, kinds) not in collected:
            collected[layers, kinds] = collect_statistics(
                runtime, pairs, keep, layers, kinds, rank=s.rank, batch_size=statistics_batch,
                cache=_cache_file(opts, runtime, spec, s, layers, kinds, preserved), progress=opts.progress,
                echo=echo,
                positions=s.positions)
        return collected[layers, kinds]

    stats = statistics(s.layers, s.kinds_text, s.method)
    times.mark("statistics")
    weights = weights_from_runtime(runtime)
    common = {"behavior": spec.name, "spec_hash": spec.spec_hash, "spec_version": spec.version}

    def solve_patch(point: Point, extra: dict | None = None) -> Patch:
        st = statistics(point.layers, point.kinds, point.method)
        settings = SolveSettings(method=point.method, strength=float(point.strength), rank=s.rank,
                                 lam=float(point.lam), threshold=float(s.threshold))
        if (point.layers, point.kinds) not in identities:
            identities[point.layers, point.kinds] = base_identity(runtime.release, list(st.keys))
        return solve(st, settings, weights=weights, base_identity=identities[point.layers, point.kinds],
                     metadata={**common, **(extra or {})}, device=runtime.device)

    start = Point(strength=max(float(g) for g in s.strength_grid) if s.strength == "auto" else float(s.strength),
                  method=s.method, lam=float(s.lam), layers=s.layers, kinds=s.kinds_text)
    found: SearchResult | None = None
    if s.strength == "auto":
        from variants.spec import STRENGTH_MAX

        echo(f"strength auto: adaptive search from {start.strength:g} on {len(spec.validation_items())} "
             f"validation prompts, at most {s.budget} generation passes")
        evaluate = validation_evaluator(runtime, spec, s, thresholds, solve_patch=solve_patch,
                                        progress=opts.progress, batch_size=batch, echo=echo,
                                        base_cache=base_answers, base_key=base_name)
        try:
            found = search(evaluate, start, budget=s.budget, min_effect=thresholds.min_effect,
                           max_strength=STRENGTH_MAX, alternatives=alternatives(s), target_effect=s.target_effect,
                           echo=echo, cost=evaluate.passes_needed)
        except NoPassingPoint as error:   # the verdict still says what the search cost
            times.mark("search")
            echo(f"{times.summary()}; search {error.result.passes} generation passes")
            raise
        assert found.chosen is not None
        start = found.chosen.point
        stats = statistics(start.layers, start.kinds, start.method)
        echo(f"search: chose {start.label()} after {found.passes} of {s.budget} passes ({found.stopped})")
        _warn_if_no_effect(found.chosen, thresholds.min_effect, echo)
    strength = start.strength
    sweep = [] if found is None else [r.to_dict() for r in found.rows]
    choice = {"strength": strength, "strength_mode": "auto" if found else "fixed", "sweep": sweep,
              **({"search": found.to_dict()} if found else {})}
    patch = solve_patch(start, choice)
    times.mark("search" if found else "solve")

    report = None
    extra_files: Any = None
    if opts.canary:
        from canaries.handles import ModelView
        from canaries.run import freeform_suite, run_canary, to_markdown

        report = run_canary(ModelView(runtime, activate=lambda: patch.applied(runtime), label="variant"),
                            ModelView(runtime, label="base"),
                            freeform_prompts=freeform_suite(spec.heldout_items(), general=True),
                            thresholds=thresholds, quality=spec.quality,
                            max_new_tokens=s.max_new_tokens, progress=opts.progress, batch_size=batch,
                            base_cache=base_answers, base_key=base_name,
                            prompted_system=spec.wanted_system_prompt())  # the prompted ceiling: final canary only
        times.mark("final canary")
        def extra_files(folder: Path) -> dict[str, bytes]:
            """Integrity of the written (not yet renamed) folder against the base, then the final gate."""
            from canaries.gate import evaluate
            from canaries.integrity import check_integrity

            report["integrity"] = check_integrity(folder, runtime.release, device=runtime.device)
            report["gate"] = evaluate(report, thresholds)
            manifest_extra["canary_gate"] = {"passed": report["gate"]["passed"], "failed": report["gate"]["failed"]}
            echo(f"canary (held-out + general + integrity): gate "
                 f"{'PASSED' if report['gate']['passed'] else 'FAILED'}"
                 + ("" if report["gate"]["passed"] else f" ({', '.join(report['gate']['failed'])})"))
            return {CANARY_JSON: json.dumps(report, indent=2, default=str).encode(),
                    CANARY_MD: to_markdown(report).encode()}
    manifest_extra = {
        **common, **choice, "method": start.method, "rank": s.rank, "lambda": start.lam,
        "threshold": s.threshold, "layers": stats.meta.get("layers"), "kinds": stats.meta.get("kinds"),
        "positions": s.positions, "questions": s.questions,
        "layers_spec": start.layers, "statistics": {k: v for k, v in stats.meta.items() if k != "shapes"},
        **({"preserve_files": [f.to_dict() for f in own.files]} if own.files else {}),
        "canary_gate": None if report is None else {"passed": report["gate"]["passed"],
                                                    "failed": report["gate"]["failed"]},
    }
    from surgery.write import write_variant

    written = write_variant(runtime.release, patch, out, force=opts.force, manifest_extra=manifest_extra,
                            progress=opts.progress, extra_files=extra_files)
    times.mark("write + integrity" if opts.canary else "write")
    if opts.export_lora:
        from surgery.lora import export_lora

        export_lora(patch, runtime.release, Path(opts.export_lora), force=opts.force)
        echo(f"LoRA adapter: {opts.export_lora}")
    seconds = times.total().wall_s
    generated = getattr(runtime, "generation_stats", None)
    rels = [i.get("rel_change") for i in patch.metadata["targets"].values() if i.get("rel_change") is not None]
    search_lines = [] if found is None else [
        f"strength search ({found.passes} of {found.budget} generation passes; {found.stopped}):",
        format_table(found.rows), f"chosen: {start.label()}"]
    summary = "\n".join([
        *search_lines,
        format_targets(patch.metadata["targets"]),
        f"edited {len(patch.names())} matrices, rank ≤ {s.rank}, method {start.method}, "
        f"strength {strength:g} ({choice['strength_mode']}), λ {start.lam:g}",
        f"relative change ‖ΔW‖/‖W‖: max {max(rels, default=0):.2e}, mean {sum(rels) / max(len(rels), 1):.2e}",
        f"wrote {written} ({_folder_bytes(written) / 1e6:.1f} MB) in {seconds:.0f} s",
        times.summary() + ("" if found is None else f"; search {found.passes} generation passes"),
        *([] if generated is None else [f"{generated.text()} (search + canaries)"]),
    ])
    echo(summary)
    return BuildResult(out=written, patch=patch, strength=strength, sweep=sweep, canary=report, summary=summary,
                       search=found, timings=times)
