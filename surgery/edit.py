"""An edit from plan to patch: choose targets, collect statistics (cached), solve each matrix.

``collect_statistics`` runs the model once; ``solve`` is closed-form and takes seconds, so a strength
sweep solves many times from one :class:`~surgery.statistics.Statistics`. The result is a
:class:`surgery.patch.Patch` (factors U, V per matrix, float32) with metadata saying how it was made.
Writing a variant from a patch is :func:`surgery.write.write_variant` (streaming, no model needed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clef_model.errors import BlazeError
from surgery import directions as dirs
from surgery import solvers
from surgery.directions import ContrastPair
from surgery.plan import layer_ranges, plan, statistics_fingerprint
from surgery.postnorm import GAIN_FLOOR, MAP_VERSION, has_post_norms, output_scales
from surgery.statistics import PreserveSet, Statistics, cache_if_small, collect
from surgery.targets import (
    WRITERS,
    parse_kinds,
    parse_layers,
    split_name,
)

if TYPE_CHECKING:
    from clef_model.runtime import Runtime
    from surgery.distill import DistillStatistics
    from surgery.patch import Patch

WeightSource = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]
LayerKernel = Mapping[int, float] | Callable[[int], float] | None


# --------------------------------------------------------------------------------------- statistics
def collect_statistics(
    runtime: Runtime,
    contrast: Sequence[ContrastPair | dict],
    preserve: PreserveSet | dict | None,
    layers: str | Iterable[int],
    kinds: str | Iterable[str],
    *,
    rank: int = 1,
    batch_size: int = 8,
    cache: Path | str | None = None,
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
    positions: str = "response",
) -> Statistics:
    """Statistics for an edit of ``kinds`` in ``layers`` (a spec such as ``"0.3-0.8"`` or ``"auto"``).

    With ``layers="auto"`` a first pass over the contrast pairs alone scores every layer
    (:func:`surgery.directions.separation_score`) and the best contiguous band is chosen
    (:func:`surgery.directions.choose_band`); the chosen layers are in ``stats.meta["layers"]``.
    With ``cache`` the result is loaded from / saved to that file when its inputs match.
    """
    pairs = [p if isinstance(p, ContrastPair) else ContrastPair(**p) for p in contrast]
    if isinstance(preserve, dict):
        preserve = PreserveSet(texts=list(preserve.get("texts", [])), requests=list(preserve.get("requests", [])))
    num_layers = len(runtime.decoder_layers())
    chosen = parse_layers(layers, num_layers) if isinstance(layers, str) else sorted(set(layers))
    say = echo or (lambda _m: None)
    extra = {"layers": str(layers), "kinds": parse_kinds(kinds), "batch_size": batch_size, "positions": positions}
    if has_post_norms(runtime.release.architecture):
        extra["output_scales"] = [MAP_VERSION, GAIN_FLOOR]   # scales of another map version are not reused
    fingerprint = statistics_fingerprint(runtime, pairs, preserve, [], extra)
    if cache and Path(cache).exists():
        stats = Statistics.load(cache)
        if stats.meta.get("fingerprint") == fingerprint:
            say(f"statistics: reusing {cache}")
            return stats
    auto_scores = None
    if chosen == "auto":
        first = collect(runtime, pairs, None, [], batch_size=batch_size, progress=progress, positions=positions)
        found = dirs.layer_directions(first.wanted_means, first.unwanted_means, rank, first.pair_direction)
        auto_scores = {l: d.separation for l, d in found.items()}
        chosen = dirs.choose_band(auto_scores, num_layers)
        say(dirs.format_scores(found, chosen))
        say(f"layers auto: chose {layer_ranges(chosen)}")
    the_plan = plan(runtime, chosen, kinds, rank=rank)
    stats = collect(runtime, pairs, preserve, the_plan.targets, residual_layers=chosen, batch_size=batch_size,
                    progress=progress, positions=positions)
    stats.output_scales = output_scales(runtime, the_plan.targets,        # writers with a post-norm only
                                        {n: k.behaviour_moment for n, k in stats.keys.items()})
    stats.meta.update({
        "fingerprint": fingerprint,
        "layers": list(chosen),
        "layers_spec": layers if isinstance(layers, str) else layer_ranges(chosen),
        "kinds": the_plan.kinds,
        "architecture": the_plan.architecture,
        "shapes": {k: list(v) for k, v in the_plan.shapes.items()},
        "layer_scores": auto_scores,
    })
    if cache:
        cache_if_small(stats, cache, say)
    return stats


# -------------------------------------------------------------------------------------------- solve
def weights_from_runtime(runtime: Runtime) -> Callable[[str], torch.Tensor]:
    """A weight source reading the live modules of a runtime."""
    linears = runtime.named_linears()
    return lambda name: linears[name].weight.detach()


def _weight(weights: WeightSource | None, name: str) -> torch.Tensor | None:
    if weights is None:
        return None
    return weights(name) if callable(weights) else weights[name]


def _kernel(layer_kernel: LayerKernel, layer: int) -> float:
    if layer_kernel is None:
        return 1.0
    if callable(layer_kernel):
        return float(layer_kernel(layer))
    return float(layer_kernel.get(layer, 0.0))


def _solve_device(stats: Statistics | DistillStatistics, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for moments in stats.keys.values():
        return moments.key_moment.device if hasattr(moments, "key_moment") else moments.behaviour_moment.device
    return torch.device("cpu")


@dataclass
class SolveResult:
    """Factors per target plus the per-target numbers for the manifest."""

    factors: dict[str, solvers.Factors]
    info: dict[str, dict[str, Any]]


def solve_factors(
    stats: Statistics | DistillStatistics,
    method: str = "steer",
    strength: float = 0.15,
    rank: int = 1,
    lam: float = 1.0,
    threshold: float = 0.01,
    layer_kernel: LayerKernel = None,
    *,
    weights: WeightSource | None = None,
    mu: float = 1e-3,
    targets: Iterable[str] | None = None,
    device: torch.device | str | None = None,
) -> SolveResult:
    """Closed-form factors for every target of ``stats`` (see :mod:`surgery.solvers` and docs/METHOD.md).

    Strength: for ``steer``/``nullspace`` each edited layer adds, at the mean behaviour key, ``strength``
    × that layer's contrastive mean difference (wanted − unwanted) along the behaviour directions,
    shared equally by the layer's edited writers; a reader's output moves by ``strength`` × the change
    the contrast causes in it. For ``ablate`` it is the fraction of the directions removed (1 = all).
    ``layer_kernel`` multiplies the strength per layer. The float64 algebra runs on ``device`` (default:
    where the statistics are, i.e. the GPU after a GPU collection).
    """
    _check_solve(stats, method, strength)
    names = list(stats.keys) if targets is None else list(targets)
    if method == "distill":
        return _solve_distill(stats, names, strength, rank, lam, mu, layer_kernel, weights,  # type: ignore[arg-type]
                              _solve_device(stats, device))
    assert isinstance(stats, Statistics)
    writers_per_layer: dict[int, int] = {}
    for name in names:
        layer, kind = split_name(name)
        if kind in WRITERS:
            writers_per_layer[layer] = writers_per_layer.get(layer, 0) + 1
    needed_layers = {split_name(n)[0] for n in names}
    dev = _solve_device(stats, device)
    layer_dirs = dirs.layer_directions(
        {l: stats.wanted_means[l] for l in needed_layers},
        {l: stats.unwanted_means[l] for l in needed_layers},
        rank,
        stats.pair_direction,
    )
    factors: dict[str, solvers.Factors] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in names:
        layer, kind = split_name(name)
        ks = stats.keys[name]
        alpha = strength * _kernel(layer_kernel, layer)
        w = _weight(weights, name)
        w = None if w is None else w.to(dev)
        writer = kind in WRITERS
        if writer:
            basis = layer_dirs[layer].basis.to(dev)
            pair_targets = (stats.wanted_means[layer] - stats.unwanted_means[layer]).to(dev).double()
            share = writers_per_layer[layer]
        else:
            if w is None:
                raise BlazeError(f"editing reader {name} needs its weight: pass weights=")
            key_diffs = (ks.wanted_means - ks.unwanted_means).to(dev).double()
            pair_targets = key_diffs @ w.double().T
            basis = dirs.principal_directions(pair_targets, rank)
            share = 1
        if method == "ablate":
            if w is None:
                raise BlazeError(f"ablate needs the weight of {name}: pass weights=")
            if writer and name in stats.output_scales:
                raise BlazeError(f"ablate cannot edit {name}: its output is normalised before the residual stream "
                                 "(Gemma 3), so removing a direction from it does not remove it from the residual; "
                                 "use --method steer, nullspace or distill, or --kinds readers")
            if writer:
                f = solvers.ablate_output(w, basis, alpha)
            else:
                f = solvers.ablate_input(w, dirs.principal_directions(key_diffs, rank), alpha)
        else:
            f = _solve_matrix(stats, name, method, rank, lam, threshold, mu, dev, basis, pair_targets)
            weights_p = ks.pair_counts.to(dev).double()
            mean_target = (pair_targets.T @ (weights_p / weights_p.sum()))      # d_out
            desired = (alpha / share) * (basis.double().T @ mean_target)
            if alpha == 0:
                f = solvers.Factors(U=f.U, V=f.V * 0.0, scale=0.0, null_dim=f.null_dim)
            else:
                f = solvers.calibrate(f, basis, ks.behaviour_mean.to(dev), desired)
            if writer and name in stats.output_scales:   # a normalised writer: residual change -> its output's
                scale = stats.output_scales[name].to(dev).double().unsqueeze(1)
                f = solvers.Factors(U=f.U * scale, V=f.V, scale=f.scale, null_dim=f.null_dim)
        factors[name] = f
        info[name] = _matrix_info(stats, name, f, w, layer_dirs[layer].separation if kind in WRITERS else None)
    return SolveResult(factors, info)


def _check_solve(stats: Statistics | DistillStatistics, method: str, strength: float) -> None:
    """A known method, a finite strength ≥ 0, and statistics of the method's kind (distill has its own)."""
    if method not in solvers.METHODS:
        raise BlazeError(f"unknown method {method!r}: use one of {', '.join(solvers.METHODS)}")
    if strength < 0 or not math.isfinite(strength):
        raise BlazeError(f"strength must be a finite number ≥ 0 (got {strength})")
    if _is_distill(stats) != (method == "distill"):
        raise BlazeError(f"method {method} needs {'distill' if method == 'distill' else 'steer/nullspace'} "
                         "statistics (surgery.distill.collect_distill_statistics for distill, "
                         "collect_statistics otherwise)")


def _is_distill(stats: Statistics | DistillStatistics) -> bool:
    # not an isinstance check on DistillStatistics: surgery.distill imports this module (plan, fingerprint)
    return not isinstance(stats, Statistics)


def _solve_distill(stats: DistillStatistics, names: list[str], strength: float, rank: int, lam: float, mu: float,
                   layer_kernel: LayerKernel, weights: WeightSource | None, dev: torch.device) -> SolveResult:
    """``distill``: each matrix's rank-k reduced-rank regression of its prompted change on its unprompted
    keys (:func:`surgery.solvers.reduced_rank_regression`), times ``strength`` × the layer kernel. The
    unscaled solve is memoised on ``stats`` (a strength sweep solves each matrix once)."""
    factors: dict[str, solvers.Factors] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in names:
        layer, _kind = split_name(name)
        m = stats.keys[name]
        memo_key = ("solve", name, "distill", rank, lam, mu, str(dev))
        base: solvers.Factors | None = stats.memo.get(memo_key)
        if base is None:
            cp = None if m.preserve_moment is None else m.preserve_moment.to(dev)
            base = solvers.reduced_rank_regression(m.cross_moment.to(dev), m.key_moment.to(dev), rank, cp,
                                                   lam=lam, mu=mu)
            stats.memo[memo_key] = base
            stats.memo[("fit", *memo_key)] = solvers.fit_fraction(base, m.cross_moment.to(dev),
                                                                  m.key_moment.to(dev), m.target_energy)
        alpha = strength * _kernel(layer_kernel, layer)
        f = solvers.Factors(U=base.U, V=base.V * alpha, scale=alpha)
        w = _weight(weights, name)
        factors[name] = f
        entry = _matrix_info(stats, name, f, None if w is None else w.to(dev), None)
        entry["fit"] = stats.memo[("fit", *memo_key)]     # share of E‖r‖² reproduced at strength 1
        info[name] = entry
    return SolveResult(factors, info)


def _solve_matrix(stats: Statistics, name: str, method: str, rank: int, lam: float, threshold: float, mu: float,
                  dev: torch.device, basis: torch.Tensor, pair_targets: torch.Tensor) -> solvers.Factors:
    """The uncalibrated steer/nullspace factors of one matrix, memoised on ``stats``.

    The solve does not depend on the strength (calibration scales it), so a strength sweep solves each
    matrix once: the d_in × d_in systems are the expensive part at 9B scale."""
    memo_key = ("solve", name, method, rank, lam, threshold, mu, str(dev))
    cached: solvers.Factors | None = stats.memo.get(memo_key)
    if cached is not None:
        return cached
    ks = stats.keys[name]
    cross = solvers.cross_moment(basis, pair_targets, ks.pair_means.to(dev), ks.pair_counts.to(dev))
    cb = ks.behaviour_moment.to(dev)
    cp = None if ks.preserve_moment is None else ks.preserve_moment.to(dev)
    if method == "steer":
        f = solvers.steer(basis, cross, cb, cp, lam=lam, mu=mu)
    else:
        if cp is None:
            raise BlazeError("nullspace needs preserved-key statistics: give a preserve set")
        f = solvers.nullspace(basis, cross, cb, cp, threshold=threshold, mu=mu)
    stats.memo[memo_key] = f
    return f


def _matrix_info(stats: Statistics | DistillStatistics, name: str, f: solvers.Factors, w: torch.Tensor | None,
                 separation: float | None) -> dict[str, Any]:
    """The manifest's numbers for one solved matrix (``separation``: the layer's, for writers only)."""
    layer, kind = split_name(name)
    u, v = f.U, f.V
    delta_norm = math.sqrt(max(float(torch.trace((u.T @ u) @ (v.T @ v))), 0.0))
    entry: dict[str, Any] = {
        "layer": layer, "kind": kind, "rank": solvers.numerical_rank(u, v), "k": int(u.shape[1]),
        "delta_norm": delta_norm, "calibration": f.scale,
    }
    if w is not None:
        norm_key = ("weight_norm", name, w.data_ptr(), tuple(w.shape))
        if norm_key not in stats.memo:
            stats.memo[norm_key] = float(w.double().norm())
        entry["rel_change"] = delta_norm / max(stats.memo[norm_key], 1e-30)
    if f.null_dim is not None:
        entry["null_dim"] = f.null_dim
    if separation is not None:
        entry["separation"] = separation
    return entry


@dataclass(frozen=True)
class SolveSettings:
    """The numbers of one closed-form solve (see :func:`solve_factors`); checked on construction, so a NaN or
    an infinity never reaches the algebra (a NaN λ would silently switch preservation off)."""

    method: str = "steer"
    strength: float = 0.15
    rank: int = 1
    lam: float = 1.0
    threshold: float = 0.01
    mu: float = 1e-3
    layer_kernel: LayerKernel = None

    def __post_init__(self) -> None:
        if self.method not in solvers.METHODS:
            raise BlazeError(f"unknown method {self.method!r}: use one of {', '.join(solvers.METHODS)}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise BlazeError(f"--rank must be an integer ≥ 1 (got {self.rank!r})")
        for name, value in (("strength", self.strength), ("lambda", self.lam), ("threshold", self.threshold),
                            ("mu", self.mu)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise BlazeError(f"{name} must be a finite number ≥ 0 (got {value!r})")

    def to_metadata(self) -> dict[str, Any]:
        """The patch metadata's record of these settings (key names as in earlier patches)."""
        return {"method": self.method, "strength": self.strength, "rank": self.rank, "lambda": self.lam,
                "threshold": self.threshold, "mu": self.mu}


def solve(
    stats: Statistics | DistillStatistics,
    settings: SolveSettings,
    *,
    weights: WeightSource | None = None,
    base_identity: dict | None = None,
    metadata: dict | None = None,
    targets: Iterable[str] | None = None,
    device: torch.device | str | None = None,
) -> Patch:
    """Solve every target and return a :class:`surgery.patch.Patch` whose metadata records the
    method, strength, rank, λ, threshold, μ, layers, kinds, per-matrix numbers and ``metadata``
    (e.g. the behaviour's ``spec_hash``). ``targets`` restricts the solve to a subset of the statistics'
    targets (e.g. only ``mlp.down_proj``) without collecting again."""
    from surgery.patch import (
        Patch,  # the I/O module; imported here so the math stays usable alone
    )

    s = settings
    result = solve_factors(stats, s.method, s.strength, s.rank, s.lam, s.threshold, s.layer_kernel,
                           weights=weights, mu=s.mu, targets=targets, device=device)
    meta = {
        **s.to_metadata(),
        "layers": stats.meta.get("layers", sorted({i["layer"] for i in result.info.values()})),
        "kinds": stats.meta.get("kinds"),
        "layer_kernel": _kernel_meta(s.layer_kernel, result.info),
        "seed": None,  # the edit is deterministic: no random numbers are drawn
        "statistics": {k: v for k, v in stats.meta.items() if k in (
            "n_pairs", "behaviour_tokens", "preserve_texts", "preserve_requests", "preserve_tokens",
            "accumulate_dtype", "fingerprint", "n_items", "response_tokens", "teacher_hit_limit",
            "teacher_sha256")},
        "targets": result.info,
        **(metadata or {}),
    }
    pairs = {name: solvers.to_float32(f) for name, f in result.factors.items()}
    return Patch(factors=pairs, base_identity=base_identity, metadata=meta)


def _kernel_meta(layer_kernel: LayerKernel, info: dict) -> dict | None:
    if layer_kernel is None:
        return None
    layers = sorted({i["layer"] for i in info.values()})
    return {str(l): _kernel(layer_kernel, l) for l in layers}


def format_targets(info: Mapping[str, Mapping[str, Any]]) -> str:
    """Per-matrix table: rank, relative change ‖ΔW‖/‖W‖."""
    lines = [f"{'target':60s} rank  ‖ΔW‖/‖W‖"]
    for name, i in info.items():
        rel = i.get("rel_change")
        lines.append(f"{name:60s} {i['rank']:4d}  {'' if rel is None else f'{rel:.2e}'}")
    return "\n".join(lines)
