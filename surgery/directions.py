"""Behaviour directions from contrastive pairs: difference of means, rank-k PCA, per-layer separation.

A contrastive pair holds one user prompt answered two ways: the wanted behaviour and the unwanted one
(given as responses and/or as system prompts). The residual stream read at the response positions of
the two sequences differs along the behaviour's direction (Arditi et al. 2024 use the same
difference-of-means construction for refusal). Everything here works on the per-pair means kept by
:mod:`surgery.statistics`, never on raw activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clef_model.errors import BlazeError


@dataclass
class ContrastPair:
    """One prompt answered with the wanted and the unwanted behaviour.

    ``prompt`` is a user message or a chat message list; ``wanted``/``unwanted`` are assistant
    responses (may be equal when the contrast is the system prompt only); the optional systems are
    system prompts used for each side. ``direction`` tags which behaviour direction the pair belongs to
    (specs with several directions, e.g. caving and flattery).
    """

    prompt: str | list[dict]
    wanted: str
    unwanted: str
    wanted_system: str | None = None
    unwanted_system: str | None = None
    direction: int = 0


@dataclass
class LayerDirection:
    """Directions of one layer: ``basis`` (d × k, orthonormal columns) with the first column aligned to
    the mean difference; ``mean_diff`` = mean(wanted − unwanted); ``separation`` score; ``rel_norm`` =
    ‖mean_diff‖ / mean residual norm at the response positions."""

    layer: int
    mean_diff: torch.Tensor
    basis: torch.Tensor
    separation: float
    rel_norm: float


def pair_differences(wanted_means: torch.Tensor, unwanted_means: torch.Tensor) -> torch.Tensor:
    """Per-pair differences (n × d) of the response-position means, wanted − unwanted."""
    if wanted_means.shape != unwanted_means.shape:
        raise ValueError("wanted and unwanted means must have the same shape")
    return (wanted_means - unwanted_means).double()


def principal_directions(differences: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank-k orthonormal basis (d × k) of the paired differences.

    The first column is the normalised mean difference (the most robust single direction); further
    columns are the top principal components (SVD) of the differences with that direction projected
    out. Each column's sign makes it agree with the mean difference where it can.
    """
    if rank < 1:
        raise BlazeError(f"rank must be ≥ 1 (got {rank})")
    d = differences.double()
    n, dim = d.shape
    if rank > min(n, dim):
        limit = min(n, dim)
        cause = f"{n} contrast pairs" if n <= dim else f"the {dim}-wide activations of these layers"
        raise BlazeError(f"rank {rank} is above the limit of {limit} here (set by {cause}): use --rank {limit} "
                         "or lower")
    mean = d.mean(0)
    norm = mean.norm()
    if norm == 0:
        raise BlazeError("wanted and unwanted activations are identical: the contrast pairs carry no signal")
    first = mean / norm
    columns = [first]
    if rank > 1:
        rest = d - torch.outer(d @ first, first)
        _, _, vh = torch.linalg.svd(rest, full_matrices=False)
        for v in vh[: rank - 1]:
            if (v @ mean) < 0:
                v = -v
            columns.append(v)
    basis = torch.stack(columns, dim=1)
    q, _ = torch.linalg.qr(basis)
    signs = torch.sign(torch.diagonal(q.T @ basis))
    signs[signs == 0] = 1
    return q * signs


def separation_score(wanted_means: torch.Tensor, unwanted_means: torch.Tensor) -> float:
    """|difference of the projected means| / pooled std of the per-pair projections onto the mean
    difference. Large when the layer separates the two behaviours reliably across prompts."""
    w = wanted_means.double()
    u = unwanted_means.double()
    diff = (w - u).mean(0)
    norm = diff.norm()
    if norm == 0:
        return 0.0
    r = diff / norm
    pw, pu = w @ r, u @ r
    pooled = torch.sqrt((pw.var(unbiased=False) + pu.var(unbiased=False)) / 2).item()
    gap = abs((pw.mean() - pu.mean()).item())
    return gap / max(pooled, 1e-12 * max(gap, 1.0))


def layer_directions(
    wanted_means: dict[int, torch.Tensor],
    unwanted_means: dict[int, torch.Tensor],
    rank: int,
    pair_direction: torch.Tensor | None = None,
) -> dict[int, LayerDirection]:
    """Directions for every layer of the statistics.

    With several behaviour directions (``pair_direction`` tags each pair), each direction contributes
    its own mean difference; the basis then spans them (one column each, then PCA columns up to
    ``rank``), so rank ≥ number of directions.
    """
    out: dict[int, LayerDirection] = {}
    for layer in sorted(wanted_means):
        w, u = wanted_means[layer], unwanted_means[layer]
        diffs = pair_differences(w, u)
        mean = diffs.mean(0)
        groups = [] if pair_direction is None else sorted(set(pair_direction.tolist()))
        if len(groups) > 1:
            means = [diffs[pair_direction == g].mean(0) for g in groups]
            if rank < len(means):
                raise BlazeError(f"rank {rank} is below the spec's {len(means)} directions: use --rank {len(means)}")
            stacked = torch.stack(means, 1)
            q, _ = torch.linalg.qr(stacked)
            signs = torch.sign(torch.diagonal(q.T @ stacked))
            signs[signs == 0] = 1
            q = q * signs
            if rank > len(means):
                rest = diffs - (diffs @ q) @ q.T
                _, _, vh = torch.linalg.svd(rest, full_matrices=False)
                extra = vh[: rank - len(means)].T
                extra, _ = torch.linalg.qr(extra - q @ (q.T @ extra))
                q = torch.cat([q, _align(extra, mean)], 1)
            basis = q
        else:
            basis = principal_directions(diffs, rank)
        residual_norm = torch.cat([w, u]).double().norm(dim=1).mean().item()
        out[layer] = LayerDirection(
            layer=layer,
            mean_diff=mean,
            basis=basis,
            separation=separation_score(w, u),
            rel_norm=mean.norm().item() / max(residual_norm, 1e-12),
        )
    return out


def _align(basis: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    signs = torch.sign(basis.T @ mean)
    signs[signs == 0] = 1
    return basis * signs


def choose_band(scores: dict[int, float], num_layers: int, width: int | None = None) -> list[int]:
    """``--layers auto``: the contiguous band of layers with the best mean separation score.

    The band is ``width`` layers wide (default 45% of the depth, the share that worked on SmolLM2 while
    blaze was designed; not re-measured in this repo) and never includes the first or the last layer: the first still
    mostly reflects token identity, the last feeds the output head directly.
    """
    if width is None:
        width = max(1, round(0.45 * num_layers))
    allowed = [l for l in sorted(scores) if 0 < l < num_layers - 1] or sorted(scores)
    if not allowed:
        raise BlazeError("no layer statistics to choose layers from")
    width = min(width, len(allowed))
    best, best_score = allowed[:width], float("-inf")
    for start in range(len(allowed) - width + 1):
        window = allowed[start : start + width]
        if window[-1] - window[0] != width - 1:
            continue
        score = sum(scores[l] for l in window) / width
        if score > best_score:
            best, best_score = window, score
    return best


def format_scores(directions: dict[int, LayerDirection], chosen: list[int] | None = None) -> str:
    """A small text table of per-layer separation, printed by ``blaze edit``."""
    lines = ["layer  separation  |mean diff|/|resid|"]
    top = max((d.separation for d in directions.values()), default=1.0) or 1.0
    for layer, d in sorted(directions.items()):
        bar = "#" * int(round(20 * d.separation / top))
        mark = "*" if chosen and layer in chosen else " "
        lines.append(f"{mark}{layer:4d}  {d.separation:10.3f}  {d.rel_norm:8.4f}  {bar}")
    return "\n".join(lines)
