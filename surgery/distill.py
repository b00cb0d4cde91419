"""Statistics for the ``distill`` method: closed-form context distillation (docs/METHOD.md, "distill").

The edit should make the model, *without* the behaviour's system prompt, compute what it computes *with*
it. Per training pair (prompt p, wanted system prompt s):

1. the teacher response y is the base model's own greedy answer to p under s (the canary's generation
   code, :meth:`clef_model.runtime.Runtime.generate`; the end-of-turn token is kept when the model stopped,
   so the last position learns to stop);
2. two teacher-forced runs: A = chat(p, system=s) + y and B = chat(p, no system) + y, read at the response
   positions (last prompt token .. last response token), aligned by their offset from the end of the prompt;
3. per target matrix W: keys k = W's input in B, targets r = W's output in A − W's output in B. Only the
   moments E[k kᵀ], E[r kᵀ], E‖r‖² and the preserved keys' E[k kᵀ] are kept, never activations.

:func:`surgery.solvers.reduced_rank_regression` turns them into a rank-k ΔW per matrix.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from clef_model.errors import BlazeError
from surgery.directions import ContrastPair
from surgery.statistics import (
    PreserveSet,
    cache_if_small,
    forward,
    load_payload,
    pad_id,
    padded_batch,
    preserve_sequences,
    save_payload,
    width_bucket,
)

if TYPE_CHECKING:
    from clef_model.runtime import Runtime

FORMAT_VERSION = 1


@dataclass(frozen=True)
class DistillItem:
    """One teacher-forced item: the prompt, the system prompt the teacher ran under and its answer's ids."""

    prompt: Any                 # a string or a list of chat messages (as in a ContrastPair)
    system: str
    response: tuple[int, ...]   # the teacher's answer, with the end-of-turn token when it stopped


@dataclass
class DistillMoments:
    """The moments of one target matrix (float tensors on the collection device or CPU)."""

    key_moment: torch.Tensor        # d_in × d_in, E[k kᵀ] over the unprompted run's response keys
    cross_moment: torch.Tensor      # d_out × d_in, E[r kᵀ], r = output(prompted) − output(unprompted)
    target_energy: float            # E‖r‖²
    count: int                      # response positions
    preserve_moment: torch.Tensor | None = None
    preserve_count: int = 0


@dataclass
class DistillStatistics:
    """Everything the ``distill`` solve needs, per target matrix; ``meta`` as in
    :class:`surgery.statistics.Statistics` (layers, kinds, counts, fingerprint)."""

    keys: dict[str, DistillMoments]
    meta: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def targets(self) -> list[str]:
        return list(self.keys)

    def nbytes(self) -> int:
        """Bytes of all tensors (what :meth:`save` writes, before compression)."""
        tensors = [v for m in self.keys.values() for v in vars(m).values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def save(self, path: Path | str) -> None:
        """Write to one file (torch.save of plain tensors and dicts), atomically."""
        payload = {
            "format": FORMAT_VERSION, "kind": "distill", "meta": self.meta,
            "keys": {name: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(m).items()}
                     for name, m in self.keys.items()},
        }
        save_payload(payload, path)

    @classmethod
    def load(cls, path: Path | str) -> DistillStatistics:
        """Read a file written by :meth:`save`."""
        payload = load_payload(path)
        if payload.get("format") != FORMAT_VERSION or payload.get("kind") != "distill":
            raise BlazeError(f"statistics file {path} is not distill statistics of this format: delete it to recompute")
        return cls(keys={name: DistillMoments(**d) for name, d in payload["keys"].items()}, meta=payload["meta"])


# ------------------------------------------------------------------------------------------- teacher
def teacher_items(runtime: Runtime, pairs: Sequence[ContrastPair], *, max_new_tokens: int,
                  batch_size: int = 8) -> list[DistillItem]:
    """The base model's own greedy answers to each pair's prompt under its wanted system prompt.

    Pairs without a wanted system prompt are skipped (there is no prompted run to distil); a prompt that
    appears twice under the same system prompt is answered once. When the model stopped before
    ``max_new_tokens``, the first of :meth:`Runtime.stop_token_ids` (the generation config's end-of-turn
    token) is appended, so the edit also learns where the prompted model stops.
    """
    by_system: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        if pair.wanted_system:
            by_system.setdefault(pair.wanted_system, {}).setdefault(repr(pair.prompt), pair.prompt)
    if not by_system:
        raise BlazeError("distill needs training pairs with a wanted system prompt (the prompted run it "
                         "reproduces); this behaviour has none: use --method steer")
    stops = runtime.stop_token_ids()
    items: list[DistillItem] = []
    for system, prompts in by_system.items():
        answers = runtime.generate(list(prompts.values()), max_new_tokens=max_new_tokens, batch_size=batch_size,
                                   system=system)
        for prompt, answer in zip(prompts.values(), answers, strict=True):
            ids = list(answer.token_ids) + ([] if answer.hit_limit or not stops else [stops[0]])
            items.append(DistillItem(prompt=prompt, system=system, response=tuple(ids)))
    return items


@dataclass
class _Run:
    """One teacher-forced sequence and the positions read (same count in the A and B run of an item)."""

    ids: list[int]
    positions: list[int]


def item_runs(runtime: Runtime, item: DistillItem, max_length: int = 1024) -> tuple[_Run, _Run]:
    """The prompted (A) and unprompted (B) run of an item, each read from its last prompt token to its last
    response token; position i of A and position i of B are the same offset from the end of the prompt.
    A response cut by ``max_length`` is cut in both runs at the same offset."""
    runs = []
    for system in (item.system, None):
        prompt_ids = list(runtime.chat_ids(item.prompt, system=system))
        if not prompt_ids:
            raise BlazeError("a distill prompt encodes to no tokens")
        runs.append((prompt_ids, list(item.response)))
    keep = min(len(r) for _, r in runs)
    keep = min(keep, min(max_length - len(p) for p, _ in runs))
    if keep < 0:
        raise BlazeError(f"a distill prompt is longer than {max_length} tokens")
    a, b = ((_Run(ids=p + r[:keep], positions=list(range(len(p) - 1, len(p) + keep)))) for p, r in runs)
    return a, b


# ---------------------------------------------------------------------------------------- collection
class _Hooks:
    """Forward hooks on the target matrices: stash the prompted run's outputs, then accumulate moments from
    the unprompted run against them; or accumulate the preserved keys' moment."""

    def __init__(self, runtime: Runtime, targets: list[str], acc: torch.dtype, device: torch.device) -> None:
        self.acc, self.device = acc, device
        self.mode = "A"
        self.flat: torch.Tensor | None = None
        self.stash: dict[str, torch.Tensor] = {}
        self.sums: dict[str, dict[str, Any]] = {}
        linears = runtime.named_linears()
        self.handles = []
        for name in targets:
            if name not in linears:
                raise BlazeError(f"target {name} is not a linear layer of this model")
            self.handles.append(linears[name].register_forward_hook(self._hook(name)))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        assert self.flat is not None, "the kept positions are set before a forward pass is captured"
        return x.reshape(-1, x.shape[-1]).index_select(0, self.flat).float()

    def _acc(self, name: str, d_out: int, d_in: int) -> dict[str, Any]:
        if name not in self.sums:
            z = lambda *shape: torch.zeros(*shape, dtype=self.acc, device=self.device)  # noqa: E731
            self.sums[name] = {"kk": z(d_in, d_in), "rk": z(d_out, d_in), "rr": 0.0, "n": 0,
                               "pp": z(d_in, d_in), "p_n": 0}
        return self.sums[name]

    def _hook(self, name: str):
        def hook(_module, inputs, output):
            out = self._rows(output)
            if self.mode == "A":
                self.stash[name] = out
                return
            keys = self._rows(inputs[0])
            a = self._acc(name, out.shape[1], keys.shape[1])
            if self.mode == "P":
                a["pp"] += (keys.T @ keys).to(self.acc)
                a["p_n"] += keys.shape[0]
                return
            target = self.stash.pop(name) - out
            a["kk"] += (keys.T @ keys).to(self.acc)
            a["rk"] += (target.T @ keys).to(self.acc)
            a["rr"] += float(target.double().pow(2).sum())
            a["n"] += keys.shape[0]
        return hook


def _batch(runs: list[_Run], pad: int, device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`surgery.statistics.padded_batch` on ``device``, the flat read positions as a tensor."""
    ids, mask, flat = padded_batch(runs, pad, width_bucket(device))
    return ids.to(device), mask.to(device), torch.tensor(flat, dtype=torch.long, device=device)


def collect_distill(runtime: Runtime, items: Sequence[DistillItem], preserve: PreserveSet | None,
                    targets: Iterable[str], *, batch_size: int = 8, max_length: int = 1024,
                    progress: bool = True) -> DistillStatistics:
    """Run each item's prompted and unprompted run (one batch of each in turn) and the preserve set, and
    return the moments of every target (see the module docstring). Right padding cannot change the read
    positions: every mixer is causal."""
    targets = list(targets)
    if not items:
        raise BlazeError("no distill items: the behaviour spec has no training pairs with a wanted system prompt")
    if not targets:
        raise BlazeError("distill needs at least one target matrix")
    device = torch.device(runtime.device)
    acc = torch.float32 if device.type == "cuda" else torch.float64
    runs = [item_runs(runtime, item, max_length) for item in items]
    kept = preserve_sequences(runtime, preserve, max_length) if preserve else []
    pad = pad_id(runtime)
    model = runtime.text_model()
    hooks = _Hooks(runtime, targets, acc, device)
    order = sorted(range(len(runs)), key=lambda i: len(runs[i][1].ids))
    bar = tqdm(total=len(runs) + len(kept), desc="statistics: distill", unit="seq", disable=not progress)
    try:
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                chunk = [runs[i] for i in order[start : start + batch_size]]
                for mode, side in (("A", 0), ("B", 1)):
                    ids, mask, hooks.flat = _batch([pair[side] for pair in chunk], pad, device)
                    hooks.mode = mode
                    forward(model, ids, mask)
                bar.update(len(chunk))
            hooks.mode = "P"
            for start in range(0, len(kept), batch_size):
                chunk_p = [_Run(ids=s.ids, positions=s.positions) for s in kept[start : start + batch_size]]
                ids, mask, hooks.flat = _batch(chunk_p, pad, device)
                forward(model, ids, mask)
                bar.update(len(chunk_p))
    finally:
        hooks.close()
        bar.close()
    keys: dict[str, DistillMoments] = {}
    for name in targets:
        a = hooks.sums.get(name)
        if a is None or a["n"] == 0:
            raise BlazeError(f"target {name} saw no response tokens: the teacher answers are empty")
        keys[name] = DistillMoments(
            key_moment=a["kk"] / a["n"], cross_moment=a["rk"] / a["n"], target_energy=a["rr"] / a["n"],
            count=int(a["n"]),
            preserve_moment=a["pp"] / a["p_n"] if a["p_n"] else None, preserve_count=int(a["p_n"]))
    meta = {
        "method": "distill", "n_items": len(items),
        "behaviour_tokens": sum(len(b.positions) for _, b in runs),
        "response_tokens": sum(len(i.response) for i in items),
        "preserve_texts": len(preserve.texts) if preserve else 0,
        "preserve_requests": len(preserve.requests) if preserve else 0,
        "preserve_tokens": sum(len(s.positions) for s in kept),
        "accumulate_dtype": str(acc).replace("torch.", ""),
    }
    return DistillStatistics(keys=keys, meta=meta)


# ------------------------------------------------------------------------------------------- driver
def collect_distill_statistics(
    runtime: Runtime,
    contrast: Sequence[ContrastPair],
    preserve: PreserveSet | None,
    layers: str | Iterable[int],
    kinds: str | Iterable[str],
    *,
    max_new_tokens: int,
    rank: int = 1,
    batch_size: int = 8,
    cache: Path | str | None = None,
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
) -> DistillStatistics:
    """Teacher answers + moments for an edit of ``kinds`` in ``layers``, cached in ``cache`` when its inputs
    match. ``layers="auto"`` is resolved as for steer (separation scores of the contrast pairs,
    :func:`surgery.edit.collect_statistics`), so both methods edit the same band."""
    from surgery import directions as dirs
    from surgery.plan import layer_ranges, plan, statistics_fingerprint
    from surgery.statistics import collect
    from surgery.targets import parse_kinds, parse_layers

    pairs = list(contrast)
    say = echo or (lambda _m: None)
    num_layers = len(runtime.decoder_layers())
    chosen = parse_layers(layers, num_layers) if isinstance(layers, str) else sorted(set(layers))
    fingerprint = statistics_fingerprint(runtime, pairs, preserve, [], {
        "method": "distill", "layers": str(layers), "kinds": parse_kinds(kinds), "batch_size": batch_size,
        "max_new_tokens": max_new_tokens, "format": FORMAT_VERSION})
    if cache and Path(cache).exists():
        try:
            stats = DistillStatistics.load(cache)
        except BlazeError:
            stats = None
        if stats is not None and stats.meta.get("fingerprint") == fingerprint:
            say(f"statistics: reusing {cache}")
            return stats
    auto_scores = None
    if chosen == "auto":
        first = collect(runtime, pairs, None, [], batch_size=batch_size, progress=progress,
                        positions="shared_response" if all(p.wanted_system and p.unwanted_system for p in pairs)
                        else "response")
        found = dirs.layer_directions(first.wanted_means, first.unwanted_means, rank, first.pair_direction)
        auto_scores = {layer: d.separation for layer, d in found.items()}
        chosen = dirs.choose_band(auto_scores, num_layers)
        say(f"layers auto: chose {layer_ranges(chosen)}")
    the_plan = plan(runtime, chosen, kinds, method="distill", rank=rank)
    say(f"distill: generating the teacher's answers to {len(pairs)} training prompts under the wanted system prompt")
    items = teacher_items(runtime, pairs, max_new_tokens=max_new_tokens, batch_size=batch_size)
    stats = collect_distill(runtime, items, preserve, the_plan.targets, batch_size=batch_size, progress=progress)
    stats.meta.update({
        "fingerprint": fingerprint, "layers": list(chosen),
        "layers_spec": layers if isinstance(layers, str) else layer_ranges(chosen), "kinds": the_plan.kinds,
        "architecture": the_plan.architecture, "layer_scores": auto_scores,
        "teacher_hit_limit": sum(1 for i in items if not i.response or i.response[-1] not in runtime.stop_token_ids()),
        "teacher_sha256": hashlib.sha256(json.dumps([[repr(i.prompt), i.system, list(i.response)] for i in items])
                                         .encode()).hexdigest(),
    })
    say(f"distill: {stats.meta['n_items']} teacher answers, {stats.meta['response_tokens']} tokens "
        f"({stats.meta['teacher_hit_limit']} ran to the token limit)")
    if cache:
        cache_if_small(stats, cache, say)
    return stats
