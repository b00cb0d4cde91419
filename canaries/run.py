"""Run every canary on a base and a variant and build the report (free-form, damage, decisions, integrity, gate).

Order: the base side runs first under `base.activate()` (or comes from a cache), then the variant side under
`variant.activate()`. The variant side needs the base's greedy continuations and its stored log-probabilities
(see `canaries.damage`), so each side touches only its own weights. Base and variant may share one Runtime (the
edit toggled in memory by `activate`) or be two Runtimes; `run_sequential` loads them one after the other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from canaries import damage as damage_mod
from canaries import decisions as decisions_mod
from canaries import freeform as freeform_mod
from canaries import gate as gate_mod
from canaries import prompted as prompted_mod
from canaries.cache import BaseCache, cache_key
from canaries.gate import Thresholds
from canaries.handles import ModelView
from canaries.integrity import check_integrity  # noqa: F401  (public API lives in this module too)
from canaries.noise import NOISE_BATCH, noise_path
from canaries.report import print_report, to_markdown  # noqa: F401  (public API)
from canaries.suites import default_decision_suite, general_prompts, request_bodies
from canaries.suites import neutral_prompts as default_neutral_prompts
from canaries.suites import neutral_texts as default_neutral_texts

__all__ = ["ModelView", "run_canary", "run_sequential", "check_integrity", "default_decision_suite", "to_markdown",
           "print_report", "freeform_suite", "collect_side", "CanarySuite", "run_freeform"]

DEFAULT_DAMAGE_TOKENS = 32


def freeform_suite(behavior_items: list[dict[str, Any]] | None = None, *, general: bool = True) -> list[dict]:
    """Free-form prompts: the general suite (tagged "general") then the behaviour's held-out items ("behavior").

    A prompt in both keeps one entry, tagged "behavior" with the behaviour's keywords.
    """
    items: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for source, group in (("general", general_prompts() if general else []), ("behavior", behavior_items or [])):
        for item in group:
            entry = {"prompt": item["prompt"], "keywords": list(item.get("keywords") or []),
                     "avoid": list(item.get("avoid") or []), "source": item.get("source", source)}
            if item.get("stance"):
                entry["stance"] = item["stance"]
            key = repr(entry["prompt"])
            if key in index:
                items[index[key]] = entry
            else:
                index[key] = len(items)
                items.append(entry)
    return items


class CanarySuite(dict):
    """The inputs of one canary run as plain data: freeform, decisions, neutral_prompts, neutral_texts."""


def _suite(freeform_prompts: list[Any], decision_requests: list[dict] | None, neutral_prompts: list[Any] | None,
           neutral_texts: list[str] | None, is_clef: bool) -> CanarySuite:
    freeform = [dict(item, source=item.get("source", "general")) if isinstance(item, dict) else
                {"prompt": item, "source": "general"} for item in freeform_prompts]
    if not freeform:
        from clef_model.errors import BlazeError

        raise BlazeError("the free-form canary needs at least one prompt")
    decisions = None
    if is_clef:
        decisions = default_decision_suite() if decision_requests is None else list(decision_requests)
    neutral = [p["prompt"] if isinstance(p, dict) else p
               for p in (default_neutral_prompts() if neutral_prompts is None else neutral_prompts)]
    texts = default_neutral_texts() if neutral_texts is None else list(neutral_texts)
    return CanarySuite(freeform=freeform, decisions=decisions, neutral_prompts=neutral, neutral_texts=texts)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    from clef_model.env import quiet

    return tqdm(total=total, desc=desc, unit="step", disable=quiet() or not enabled, leave=False)


def collect_side(view: ModelView, suite: CanarySuite, settings: dict[str, Any], reference: dict | None = None,
                 progress: bool = True) -> dict[str, Any]:
    """Everything one model contributes to the report, computed inside `view.activate()`.

    With `reference=None` this is the base side (it also keeps the damage reference); otherwise the variant
    side, which teacher-forces the base's continuations and compares against its stored log-probabilities.
    """
    runtime = view.runtime
    batch = settings["batch_size"]
    steps = 3 if suite["decisions"] else 2
    warned = len(getattr(runtime, "warnings", []))  # this side reports only the warnings of its own run
    started = time.perf_counter()
    with view.activate(), _progress(steps, progress, f"canary {view.label}") as bar:
        bar.set_postfix_str("free-form")
        generations = runtime.generate([item["prompt"] for item in suite["freeform"]],
                                       max_new_tokens=settings["max_new_tokens"], batch_size=batch)
        side: dict[str, Any] = {"generations": [freeform_mod.generation_dict(g) for g in generations]}
        bar.update()
        bar.set_postfix_str("damage")
        if reference is None:
            side["damage"] = damage_mod.reference_pass(runtime, suite["neutral_prompts"], suite["neutral_texts"],
                                                       damage_tokens=settings["damage_tokens"], batch_size=batch)
        else:
            side["damage"] = damage_mod.compare_pass(runtime, reference["damage"], batch_size=batch)
        bar.update()
        if suite["decisions"]:
            bar.set_postfix_str("decisions")
            side["decisions"] = runtime.decision_probabilities(request_bodies(suite["decisions"]), batch_size=batch)
            bar.update()
    side["seconds"] = time.perf_counter() - started
    side["warnings"] = list(getattr(runtime, "warnings", [])[warned:])  # e.g. a decision request's state cut
    return side


def report_warnings(*sides: dict) -> list[str]:
    """The runtime warnings of the report's runs (e.g. a decision request whose state was cut to the token
    limit), each once in order: base and variant cut the same request the same way."""
    return list(dict.fromkeys(w for side in sides if side for w in side.get("warnings", [])))


def collect_prompted(view: ModelView, suite: CanarySuite, settings: dict[str, Any], system: str,
                     progress: bool = True) -> dict[str, Any]:
    """The prompted ceiling's answers: the base, inside `view.activate()`, on the effect items under `system`."""
    items = [suite["freeform"][i] for i in freeform_mod.effect_indices(suite["freeform"])]
    started = time.perf_counter()
    with view.activate(), _progress(1, progress, f"canary {view.label} prompted") as bar:
        generations = view.runtime.generate([item["prompt"] for item in items], system=system,
                                            max_new_tokens=settings["max_new_tokens"],
                                            batch_size=settings["batch_size"])
        bar.update()
    return {"system": system, "generations": [freeform_mod.generation_dict(g) for g in generations],
            "seconds": time.perf_counter() - started}


def collect_noise(view: ModelView, prompts: list[Any], settings: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """The base's greedy answers to ``prompts`` again, one prompt per batch (`canaries.noise`), inside
    ``view.activate()``."""
    started = time.perf_counter()
    with view.activate(), _progress(1, progress, f"canary {view.label} noise floor") as bar:
        generations = view.runtime.generate(prompts, max_new_tokens=settings["max_new_tokens"], batch_size=NOISE_BATCH)
        bar.update()
    return {"path": noise_path(int(settings["batch_size"])),
            "generations": [freeform_mod.generation_dict(g) for g in generations], "seconds": time.perf_counter() - started}


def _prompted_key(base_identity: str, suite: CanarySuite, settings: dict, system: str) -> str:
    """Cache key of the prompted run: base, the effect items' prompts, the system prompt and the settings."""
    prompts = [suite["freeform"][i]["prompt"] for i in freeform_mod.effect_indices(suite["freeform"])]
    return cache_key(base_identity, {"prompted_system": system, "prompts": prompts}, settings)


def _prompts(suite: CanarySuite) -> list[Any]:
    return [item["prompt"] for item in suite["freeform"]]


def _noise_key(base_identity: str, suite: CanarySuite, settings: dict) -> str:
    """Cache key of the free-form noise-floor run: base, the free-form prompts and the settings."""
    return cache_key(base_identity, {"freeform_noise": _prompts(suite), "noise_batch": NOISE_BATCH}, settings)


def _settings(max_new_tokens: int, batch_size: int, damage_tokens: int, runtime: Any) -> dict[str, Any]:
    return {"max_new_tokens": int(max_new_tokens), "batch_size": int(batch_size), "damage_tokens": int(damage_tokens),
            "device": str(getattr(runtime, "device", "")), "dtype": str(getattr(runtime, "dtype", ""))}


def build_report(suite: CanarySuite, base_side: dict, variant_side: dict, *, thresholds: Any,
                 quality: str | None, integrity: dict | None, settings: dict, labels: tuple[str, str],
                 prompted: dict | None = None, noise: dict | None = None) -> dict:
    """Assemble the report sections from both sides' outputs and run the gate.

    `prompted` (`collect_prompted`'s output) adds the prompted ceiling as `freeform.prompted`; without it
    that key is None (the run was not asked for it, e.g. a point of the strength search). `noise`
    (`collect_noise`'s output) adds `freeform.noise_floor` (else None); the gate does not read it.
    """
    freeform = freeform_mod.compare_answers(suite["freeform"], base_side["generations"], variant_side["generations"],
                                            quality)
    freeform["prompted"] = None
    if prompted is not None:
        effect = gate_mod.resolve_thresholds(thresholds).effect
        freeform["prompted"] = prompted_mod.prompted_ceiling(freeform["prompts"], suite["freeform"],
                                                             prompted["system"], prompted["generations"],
                                                             effect).to_dict()
    freeform["noise_floor"] = None
    if noise is not None:
        from canaries.noise import summarize_noise

        freeform["noise_floor"] = summarize_noise(suite["freeform"], base_side["generations"], noise["generations"],
                                                  noise["path"]).to_dict()
    report: dict[str, Any] = {
        "freeform": freeform,
        "damage": damage_mod.summarize(suite["neutral_prompts"], base_side["damage"], variant_side["damage"]),
        "decisions": (decisions_mod.compare_decisions(suite["decisions"], base_side["decisions"],
                                                      variant_side["decisions"])
                      if suite["decisions"] is not None else decisions_mod.not_applicable()),
        "integrity": integrity,
        "warnings": report_warnings(base_side, variant_side),
    }
    report["gate"] = gate_mod.evaluate(report, thresholds or {})
    report["meta"] = {"settings": settings, "base_label": labels[0], "variant_label": labels[1],
                      "seconds": {"base": base_side.get("seconds"), "variant": variant_side.get("seconds"),
                                  "prompted": None if prompted is None else prompted.get("seconds"),
                                  "noise_floor": None if noise is None else noise.get("seconds")},
                      "base_from_cache": bool(base_side.get("from_cache")),
                      "prompted_from_cache": None if prompted is None else bool(prompted.get("from_cache"))}
    return report


def run_canary(variant: ModelView, base: ModelView, *, freeform_prompts: list[dict[str, Any]],
               decision_requests: list[dict] | None = None, neutral_prompts: list[Any] | None = None,
               neutral_texts: list[str] | None = None, thresholds: Thresholds | Mapping[str, Any] | None = None, quality: str | None = None,
               max_new_tokens: int = 96, integrity: dict | None = None, progress: bool = True,
               batch_size: int = 16, damage_tokens: int = DEFAULT_DAMAGE_TOKENS,
               base_cache: BaseCache | None = None, base_key: str | None = None,
               prompted_system: str | None = None, noise_floor: bool = False) -> dict[str, Any]:
    """Run every canary and return the report: keys freeform, damage, decisions, integrity, gate (+ meta).

    `freeform_prompts`: `{"prompt", "keywords"?, "avoid"?, "source"?}` items (see `freeform_suite`; the effect is
    measured on items with source "behavior" when any). `decision_requests`: SystemOne requests with optional
    `labels`; None means `default_decision_suite()`; ignored for plain causal LMs (the section then says it does
    not apply). `neutral_prompts`/`neutral_texts`: None means the shipped suites. `thresholds`: a
    `canaries.gate.Thresholds` (a behaviour spec's gate), or a mapping of some of its fields over the defaults.
    `integrity`: a `check_integrity` result to include and gate on. `base_cache` (+ `base_key` naming the base)
    reuses the base side across calls, e.g. a `MemoryCache` across the points of a strength sweep.
    `prompted_system`: also run the base under this system prompt (the spec's wanted one) on the effect items
    and report the prompted ceiling (`canaries.prompted`); None (the default, as in search points) skips that
    run. The cache keeps it too. `noise_floor`: also rerun the base one prompt per batch and report what moved
    (`canaries.noise`), cached like the base's answers.
    """
    is_clef = bool(getattr(base.runtime, "is_clef", False)) and bool(getattr(variant.runtime, "is_clef", False))
    suite = _suite(freeform_prompts, decision_requests, neutral_prompts, neutral_texts, is_clef)
    settings = _settings(max_new_tokens, batch_size, damage_tokens, base.runtime)
    identity = base_key or f"runtime-{id(base.runtime)}"
    base_side = _base_side(base, suite, settings, base_cache, identity, progress)
    prompted = None
    if prompted_system:
        prompted = _cached(base_cache, _prompted_key(identity, suite, settings, prompted_system),
                           lambda: collect_prompted(base, suite, settings, prompted_system, progress))
    noise = None
    if noise_floor:
        noise = _cached(base_cache, _noise_key(identity, suite, settings),
                        lambda: collect_noise(base, _prompts(suite), settings, progress))
    variant_side = collect_side(variant, suite, settings, reference=base_side, progress=progress)
    return build_report(suite, base_side, variant_side, thresholds=thresholds, quality=quality, integrity=integrity,
                        settings=settings, labels=(base.label, variant.label), prompted=prompted, noise=noise)


def run_freeform(variant: ModelView, base: ModelView, *, freeform_prompts: list[dict[str, Any]],
                 max_new_tokens: int = 96, batch_size: int = 16, quality: str | None = None,
                 base_cache: BaseCache | None = None, base_key: str | None = None) -> dict[str, Any]:
    """The free-form section alone (`canaries.freeform.compare_answers`): both models' greedy answers to
    `freeform_prompts`, the base's from `base_cache` when there. No damage, decision or gate pass: for
    checks that read only the answers, such as the strength search's loop check, where those passes
    would be spent and thrown away. Same answers as the free-form part of `run_canary` with the same
    prompts, `max_new_tokens` and `batch_size` (same batches, same greedy decode)."""
    items = _suite(freeform_prompts, None, [], [], False)["freeform"]
    settings = _settings(max_new_tokens, batch_size, 0, base.runtime)

    def answers(view: ModelView) -> dict[str, Any]:
        with view.activate():
            generations = view.runtime.generate([item["prompt"] for item in items], max_new_tokens=max_new_tokens,
                                                batch_size=batch_size)
        return {"generations": [freeform_mod.generation_dict(g) for g in generations]}

    identity = base_key or f"runtime-{id(base.runtime)}"
    base_side = _cached(base_cache, cache_key(identity, {"freeform_only": items}, settings), lambda: answers(base))
    return freeform_mod.compare_answers(items, base_side["generations"], answers(variant)["generations"], quality)


def _cached(cache: BaseCache | None, key: str, compute: Callable[[], dict]) -> dict:
    """`cache[key]` (marked from_cache) when present, else `compute()`, stored under key."""
    if cache is not None:
        cached = cache.get(key)
        if cached is not None:
            return dict(cached, from_cache=True)
    value = compute()
    if cache is not None:
        cache.put(key, value)
    return value


def _base_side(base: ModelView, suite: CanarySuite, settings: dict, cache: BaseCache | None, identity: str,
               progress: bool) -> dict:
    return _cached(cache, cache_key(identity, dict(suite), settings),
                   lambda: collect_side(base, suite, settings, reference=None, progress=progress))


def run_sequential(load_variant: Callable[[], Any], load_base: Callable[[], Any], *,
                   freeform_prompts: list[dict[str, Any]], decision_requests: list[dict] | None = None,
                   neutral_prompts: list[Any] | None = None, neutral_texts: list[str] | None = None,
                   thresholds: Thresholds | Mapping[str, Any] | None = None, quality: str | None = None, max_new_tokens: int = 96,
                   integrity: dict | None = None, progress: bool = True, batch_size: int = 16,
                   damage_tokens: int = DEFAULT_DAMAGE_TOKENS, base_cache: BaseCache | None = None,
                   base_key: str | None = None, base_is_clef: bool | None = None,
                   prompted_system: str | None = None, noise_floor: bool = False) -> dict[str, Any]:
    """Like `run_canary`, for models that do not fit in memory together: base first (or from the cache), freed,
    then the variant. `load_*` return Runtimes; the base is only loaded on a cache miss (of its side or, with
    `prompted_system`, of its prompted run; then `base_is_clef` may be None); on a hit `base_is_clef` must say
    whether the base is a Clef release.
    """
    import gc

    import torch

    suite: CanarySuite | None = None
    settings: dict[str, Any] | None = None
    base_side = None
    prompted = None
    noise = None
    cache, key = (base_cache, base_key) if base_cache is not None and base_key is not None else (None, None)
    if cache is not None and key is not None and base_is_clef is not None:
        suite = _suite(freeform_prompts, decision_requests, neutral_prompts, neutral_texts, base_is_clef)
        settings = {**_settings(max_new_tokens, batch_size, damage_tokens, None), "device": "", "dtype": ""}
        cached = cache.get(cache_key(key, dict(suite), settings))
        base_side = dict(cached, from_cache=True) if cached is not None else None
        if prompted_system:
            cached = cache.get(_prompted_key(key, suite, settings, prompted_system))
            prompted = dict(cached, from_cache=True) if cached is not None else None
        if noise_floor:
            cached = cache.get(_noise_key(key, suite, settings))
            noise = dict(cached, from_cache=True) if cached is not None else None
    if base_side is None or (prompted_system and prompted is None) or (noise_floor and noise is None):
        runtime = load_base()
        view = ModelView(runtime, label="base")
        if base_side is None:
            suite = _suite(freeform_prompts, decision_requests, neutral_prompts, neutral_texts,
                           bool(getattr(runtime, "is_clef", False)))
            settings = {**_settings(max_new_tokens, batch_size, damage_tokens, None), "device": "", "dtype": ""}
            base_side = collect_side(view, suite, settings, progress=progress)
            if cache is not None and key is not None:
                cache.put(cache_key(key, dict(suite), settings), base_side)
        assert suite is not None and settings is not None  # set by the cache lookup or by the base run just above
        if prompted_system and prompted is None:
            prompted = collect_prompted(view, suite, settings, prompted_system, progress=progress)
            if cache is not None and key is not None:
                cache.put(_prompted_key(key, suite, settings, prompted_system), prompted)
        if noise_floor and noise is None:
            noise = collect_noise(view, _prompts(suite), settings, progress=progress)
            if cache is not None and key is not None:
                cache.put(_noise_key(key, suite, settings), noise)
        del runtime, view
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    assert suite is not None and settings is not None  # a cache hit for the base side set both
    variant_runtime = load_variant()
    if suite["decisions"] is not None and not getattr(variant_runtime, "is_clef", False):
        suite = CanarySuite(suite, decisions=None)
    variant_side = collect_side(ModelView(variant_runtime, label="variant"), suite, settings, reference=base_side,
                                progress=progress)
    return build_report(suite, base_side, variant_side, thresholds=thresholds, quality=quality, integrity=integrity,
                        settings=settings, labels=("base", "variant"), prompted=prompted, noise=noise)
