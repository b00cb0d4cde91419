"""What an edit touches, before any statistics: the layers and matrices of a plan, and the fingerprint that
keys cached statistics. Shared by ``steer``/``nullspace`` statistics (:mod:`surgery.edit`) and ``distill``
statistics (:mod:`surgery.distill`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clef_model.errors import BlazeError
from surgery import solvers
from surgery.directions import ContrastPair
from surgery.statistics import PreserveSet
from surgery.targets import parse_kinds, parse_layers, resolve_targets

if TYPE_CHECKING:
    from clef_model.runtime import Runtime


# --------------------------------------------------------------------------------------------- plan
@dataclass
class EditPlan:
    """What an edit will touch: layers, kinds and the resolved target names with their shapes."""

    architecture: str
    num_layers: int
    layers: list[int]
    kinds: list[str]
    targets: list[str]
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    method: str = "steer"
    rank: int = 1


def layer_ranges(layers: Sequence[int]) -> str:
    """Layers as compact text (``9-23`` or ``3,5,7-9``) for messages and the manifest."""
    out, layers = [], sorted(layers)
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(out)


def plan(runtime: Runtime, layers: str | Iterable[int], kinds: str | Iterable[str], *, method: str = "steer",
         rank: int = 1) -> EditPlan:
    """Resolve a layer spec (not ``auto``: see :func:`surgery.edit.collect_statistics`) and kinds on a loaded runtime."""
    if method not in solvers.METHODS:
        raise BlazeError(f"unknown method {method!r}: use one of {', '.join(solvers.METHODS)}")
    if rank < 1:
        raise BlazeError(f"--rank must be ≥ 1 (got {rank})")
    num_layers = len(runtime.decoder_layers())
    chosen = parse_layers(layers, num_layers) if isinstance(layers, str) else sorted(set(layers))
    if chosen == "auto":
        raise BlazeError("plan() needs concrete layers; 'auto' is resolved by collect_statistics")
    linears = runtime.named_linears()
    names = resolve_targets(linears, runtime.release.architecture, num_layers, chosen, kinds)
    shapes = {n: (linears[n].weight.shape[0], linears[n].weight.shape[1]) for n in names}  # (d_out, d_in)
    return EditPlan(runtime.release.architecture, num_layers, list(chosen), parse_kinds(kinds), names, shapes,
                    method, rank)


def statistics_fingerprint(runtime: Any, pairs: Sequence[ContrastPair], preserve: PreserveSet | None, targets: list[str],
                           extra: dict) -> str:
    """SHA-256 of everything statistics depend on (model, dtype, data, targets, ``extra``): a cache file
    whose fingerprint differs is recollected."""
    data = {
        "model": str(getattr(runtime.release, "path", "")),
        "ref": getattr(runtime.release, "ref", None),
        "revision": getattr(runtime.release, "revision", None),
        "dtype": str(getattr(runtime, "dtype", "")),
        "pairs": [vars(p) for p in pairs],
        "preserve": {"texts": preserve.texts, "requests": preserve.requests,
                     **({"questions": preserve.questions} if preserve.questions else {})} if preserve else None,
        "targets": targets,
        **extra,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
