"""Activation statistics for an edit: run the decoder stack once over the data, keep only moments.

Two kinds of statistics are kept (never raw activations):

- per decoder layer, the mean residual stream (the layer's output) over each contrast pair's response
  positions, for the wanted and the unwanted side (n_pairs × d each) — enough for difference-of-means
  directions, PCA of the paired differences and separation scores;
- per target matrix, statistics of its input ("keys"): the mean and second moment E[k kᵀ] over
  behaviour keys (response positions of both sides of every pair), the same over preserved keys
  (every position of the typed-decision requests and of neutral chat text), and per-pair key means.

For writers whose output is normalised before the residual (Gemma 3) a :class:`Statistics` also holds the
residual-to-output scale of :mod:`surgery.postnorm` (``output_scales``, set by
``surgery.edit.collect_statistics``).

Moments are accumulated on the runtime's device through forward hooks: each batch's product in float32,
the running sums in float32 (CUDA, memory) or float64 (CPU); the final ``lm_head`` is never run. A :class:`Statistics` object saves to one file with
``torch.save`` so a strength sweep or a second build reuses it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm.auto import tqdm

from clef_model.errors import BlazeError
from surgery.directions import ContrastPair

if TYPE_CHECKING:
    from clef_model.runtime import Runtime

FORMAT_VERSION = 1


def save_payload(payload: dict, path: Path | str) -> None:
    """Write a statistics payload (plain tensors and dicts) to one file, atomically: a killed run leaves the
    old file or none, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_payload(path: Path | str) -> dict:
    """Read a payload written by :func:`save_payload`, tensors only (``weights_only``: a planted pickle does not
    run); an unreadable file is a clear error that says to delete it."""
    try:
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file is a user-facing problem
        raise BlazeError(f"cannot read statistics file {path}: {error}; delete it to recompute") from error
    if not isinstance(payload, dict):
        raise BlazeError(f"statistics file {path} holds no statistics: delete it to recompute")
    return payload


class _Cacheable(Protocol):
    def nbytes(self) -> int: ...
    def save(self, path: Path | str) -> None: ...


CACHE_LIMIT_ENV = "BLAZE_STATS_CACHE_MAX_GB"


def cache_if_small(stats: _Cacheable, cache: Path | str, say: Callable[[str], None]) -> None:
    """Save statistics (steer's or distill's) to ``cache`` unless they exceed the cache limit
    (``BLAZE_STATS_CACHE_MAX_GB``).

    At 9B scale the key moments of 34 matrices are ≈ 23 GB: writing them cost ≈ 30 s and the page cache flush
    then slowed the variant's own write (GPU run, BENCHMARKS.md). Recollecting is cheaper."""
    from clef_model.env import stats_cache_max_bytes

    size, limit = stats.nbytes(), stats_cache_max_bytes()
    if size <= limit:
        stats.save(cache)
    else:
        say(f"statistics: {size / 1e9:.1f} GB, above the cache limit of {limit / 1e9:g} GB: kept in memory, "
            f"not saved (set {CACHE_LIMIT_ENV} to raise the limit)")


@dataclass
class PreserveSet:
    """What must not change: neutral chat prompts and SystemOne requests (Clef releases only)."""

    texts: list[Any] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    questions: list[Any] = field(default_factory=list)
    """Chat prompts whose question tokens are preserved but not their generation prompt (the positions that
    write the answer's first token stay free to change): ``blaze edit --questions preserve``."""


@dataclass
class KeyStats:
    """Input statistics of one target matrix (float tensors on the collection device or CPU)."""

    behaviour_mean: torch.Tensor       # d_in
    behaviour_moment: torch.Tensor     # d_in × d_in, E[k kᵀ]
    behaviour_count: int
    pair_means: torch.Tensor           # n_pairs × d_in, mean key per pair (both sides)
    pair_counts: torch.Tensor          # n_pairs
    wanted_means: torch.Tensor         # n_pairs × d_in, mean key on the wanted side
    unwanted_means: torch.Tensor       # n_pairs × d_in
    preserve_moment: torch.Tensor | None = None
    preserve_count: int = 0


@dataclass
class Statistics:
    """Everything :func:`surgery.edit.solve` needs; see the module docstring."""

    wanted_means: dict[int, torch.Tensor]     # layer -> n_pairs × d (residual after the layer)
    unwanted_means: dict[int, torch.Tensor]
    pair_direction: torch.Tensor              # n_pairs, index of the spec direction of each pair
    keys: dict[str, KeyStats]                 # target name -> key statistics
    meta: dict = field(default_factory=dict)
    # writer name -> residual-to-output scale, for writers normalised before the residual (surgery.postnorm)
    output_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    # strength-independent solver results, reused by every point of a strength sweep (never saved)
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def layers(self) -> list[int]:
        return sorted(self.wanted_means)

    @property
    def targets(self) -> list[str]:
        return list(self.keys)

    def nbytes(self) -> int:
        """Bytes of all tensors (what :meth:`save` would write, before compression)."""
        tensors = [*self.wanted_means.values(), *self.unwanted_means.values(), self.pair_direction]
        tensors += [v for ks in self.keys.values() for v in vars(ks).values() if isinstance(v, torch.Tensor)]
        tensors += list(self.output_scales.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def save(self, path: Path | str) -> None:
        """Write to one file (torch.save of plain tensors and dicts)."""
        payload = {
            "format": FORMAT_VERSION,
            "wanted_means": {k: v.cpu() for k, v in self.wanted_means.items()},
            "unwanted_means": {k: v.cpu() for k, v in self.unwanted_means.items()},
            "pair_direction": self.pair_direction.cpu(),
            "keys": {
                name: {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(ks).items()}
                for name, ks in self.keys.items()
            },
            "meta": self.meta,
            "output_scales": {k: v.cpu() for k, v in self.output_scales.items()},
        }
        save_payload(payload, path)

    @classmethod
    def load(cls, path: Path | str) -> Statistics:
        """Read a file written by :meth:`save`."""
        payload = load_payload(path)
        if payload.get("format") != FORMAT_VERSION:
            raise BlazeError(f"statistics file {path} has an old format: delete it to recompute")
        return cls(
            wanted_means=payload["wanted_means"],
            unwanted_means=payload["unwanted_means"],
            pair_direction=payload["pair_direction"],
            # files written before preserve_mean was dropped still hold it: only the known fields are read
            keys={name: KeyStats(**{k: v for k, v in d.items() if k in KeyStats.__dataclass_fields__})
                  for name, d in payload["keys"].items()},
            meta=payload["meta"],
            output_scales=payload.get("output_scales", {}),
        )


@dataclass
class _Sequence:
    ids: list[int]
    positions: list[int]     # positions whose statistics are kept
    pair: int = -1           # contrast pair index, -1 for preserved text
    side: int = 0            # 0 wanted, 1 unwanted


def _response_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


POSITIONS = ("response", "prompt_end", "shared_response")


def contrast_sequences(runtime: Runtime, pairs: Sequence[ContrastPair], max_length: int = 1024,
                       positions: str = "response") -> list[_Sequence]:
    """Token sequences for both sides of every pair, with the positions to read.

    ``positions="response"``: those that predict a response token, from the last prompt token (which
    predicts the first response token) to the last response token (which predicts the end).
    ``positions="prompt_end"``: only the last prompt token, responses left out — the system-prompt
    contrast alone (the recipe that worked on SmolLM2 while blaze was designed); the direction then carries the "mode", not the
    content of the two responses.
    ``positions="shared_response"``: each of the pair's responses (wanted, then unwanted) follows the
    prompt under *both* system prompts, read at the response positions as with ``"response"``: the two
    sides see the same tokens, so they differ by their system prompts alone, and the keys are positions
    where an answer is being written (where the edit must act during generation).
    """
    if positions not in POSITIONS:
        raise BlazeError(f"positions must be one of {POSITIONS} (got {positions!r})")
    out: list[_Sequence] = []
    for index, pair in enumerate(pairs):
        if positions == "shared_response":
            responses = [pair.wanted] + ([pair.unwanted] if pair.unwanted != pair.wanted else [])
            for side, system in enumerate((pair.wanted_system, pair.unwanted_system)):
                prompt_ids = list(runtime.chat_ids(pair.prompt, system=system))
                for response in responses:
                    ids = (prompt_ids + _response_ids(runtime.tokenizer, response))[:max_length]
                    start = min(len(prompt_ids), len(ids)) - 1
                    if start < 0:
                        raise BlazeError(f"contrast pair {index} encodes to no tokens")
                    out.append(_Sequence(ids=ids, positions=list(range(start, len(ids))), pair=index, side=side))
            continue
        for side, (system, response) in enumerate(
            ((pair.wanted_system, pair.wanted), (pair.unwanted_system, pair.unwanted))
        ):
            prompt_ids = list(runtime.chat_ids(pair.prompt, system=system))
            if positions == "prompt_end":
                response = ""
            ids = (prompt_ids + _response_ids(runtime.tokenizer, response))[:max_length]
            start = min(len(prompt_ids), len(ids)) - 1
            if start < 0:
                raise BlazeError(f"contrast pair {index} encodes to no tokens")
            out.append(_Sequence(ids=ids, positions=list(range(start, len(ids))), pair=index, side=side))
    return out


def preserve_sequences(runtime: Runtime, preserve: PreserveSet, max_length: int = 2048) -> list[_Sequence]:
    """Every position of the neutral chat prompts and of the encoded SystemOne requests; of the questions,
    every position before the generation prompt (and never the last, which writes the first answer token)."""
    out: list[_Sequence] = []
    for prompt in preserve.texts:
        ids = list(runtime.chat_ids(prompt))[:max_length]
        out.append(_Sequence(ids=ids, positions=list(range(len(ids)))))
    for prompt in preserve.questions:
        ids = list(runtime.chat_ids(prompt))[:max_length]
        end = min(len(runtime.chat_ids(prompt, generation_prompt=False)), len(ids) - 1)
        if end > 0:
            out.append(_Sequence(ids=ids, positions=list(range(end))))
    if preserve.requests:
        if not getattr(runtime, "is_clef", False):
            raise BlazeError("typed-decision requests in the preserve set need a Clef release")
        for record in runtime.encode_requests(list(preserve.requests)):
            ids = record.input_ids
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            ids = [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)][:max_length]
            out.append(_Sequence(ids=ids, positions=list(range(len(ids)))))
    return out


STATISTICS_BATCH = 8  # sequences per statistics forward (a prefill: compute-bound, larger batches only pad more)


class _PassDone(Exception):
    """Raised by the hook on the last layer the statistics read: the layers above it are not run."""


def _stop_pass(_module: Any, _inputs: Any, _output: Any) -> None:
    raise _PassDone


def last_layer_read(residual_layers: Iterable[int], targets: Iterable[str]) -> int | None:
    """The deepest layer whose output or inputs the statistics read (None: unknown, run every layer).

    The layers above it cannot change anything collected, so a pass stops there: with the default band
    0.3-0.8 that skips about a fifth of each statistics forward (and the final norm)."""
    from surgery.targets import split_name

    try:
        deepest = [*residual_layers, *(split_name(name)[0] for name in targets)]
    except BlazeError:   # a target that is not a per-layer matrix: keep the whole forward
        return None
    return max(deepest, default=None)


class _Collector:
    """Forward hooks that turn activations into sums, with a batch's position bookkeeping."""

    def __init__(self, runtime: Runtime, targets: list[str], n_pairs: int, residual_layers: list[int],
                 acc_dtype: torch.dtype, device: torch.device) -> None:
        self.device, self.acc = device, acc_dtype
        self.n_pairs = n_pairs
        self.flat: torch.Tensor | None = None   # flat (b*T + t) indices of kept positions
        self.pair: torch.Tensor | None = None
        self.side: torch.Tensor | None = None
        self.mode = "behaviour"
        self.res_sum: dict[int, torch.Tensor] = {}
        self.key: dict[str, dict[str, Any]] = {}
        self.handles = []
        layers = runtime.decoder_layers()
        for layer in residual_layers:
            self.handles.append(layers[layer].register_forward_hook(self._residual_hook(layer)))
        linears = runtime.named_linears()
        for name in targets:
            if name not in linears:
                raise BlazeError(f"target {name} is not a linear layer of this model")
            self.handles.append(linears[name].register_forward_pre_hook(self._key_hook(name)))
        last = last_layer_read(residual_layers, targets)
        if last is not None and last < len(layers) - 1:
            # registered after the layer's residual hook, so that hook has run when this one stops the pass
            self.handles.append(layers[last].register_forward_hook(_stop_pass))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _rows(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        assert self.flat is not None, "the kept positions are set before a forward pass is captured"
        return x.reshape(-1, x.shape[-1]).index_select(0, self.flat).to(dtype or self.acc)

    def _pair_rows(self) -> torch.Tensor:
        """Each kept position's row of the per-pair sums: side · n_pairs + pair."""
        assert self.side is not None and self.pair is not None, "set with the kept positions"
        return self.side * self.n_pairs + self.pair

    def _moment(self, rows32: torch.Tensor) -> torch.Tensor:
        """This batch's Σ k kᵀ: the product runs in float32 (fast), the running sum is kept in ``acc``."""
        return (rows32.T @ rows32).to(self.acc)

    def _residual_hook(self, layer: int):
        def hook(_module, _inputs, output):
            if self.mode != "behaviour":
                return
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            rows = self._rows(hidden)
            if layer not in self.res_sum:
                self.res_sum[layer] = torch.zeros(2 * self.n_pairs, rows.shape[1], dtype=self.acc, device=self.device)
            self.res_sum[layer].index_add_(0, self._pair_rows(), rows)
        return hook

    def _key_hook(self, name: str):
        def hook(_module, inputs):
            rows32 = self._rows(inputs[0], torch.float32)
            rows = rows32.to(self.acc)
            d = rows.shape[1]
            acc = self.key.get(name)
            if acc is None:
                z = lambda *shape: torch.zeros(*shape, dtype=self.acc, device=self.device)  # noqa: E731
                acc = self.key[name] = {
                    "b_sum": z(d), "b_mom": z(d, d), "b_n": 0, "p_mom": z(d, d), "p_n": 0,
                    "pair_sum": z(2 * self.n_pairs, d),
                }
            if self.mode == "behaviour":
                acc["b_sum"] += rows.sum(0)
                acc["b_mom"] += self._moment(rows32)
                acc["b_n"] += rows.shape[0]
                acc["pair_sum"].index_add_(0, self._pair_rows(), rows)
            else:
                acc["p_mom"] += self._moment(rows32)
                acc["p_n"] += rows.shape[0]
        return hook


_WIDTH_BUCKET = 64


def width_bucket(device: torch.device | str) -> int:
    """The multiple a statistics batch's padded width is rounded up to: 64 on CUDA, where shape-specialised
    kernels (fla's Triton kernels compile/autotune per sequence length) then see a few shapes instead of one
    per batch; 1 elsewhere, where each padded token is only compute (on SmolLM2's verbosity statistics the
    64-token bucket ran 1.30× the tokens of exact widths: BENCHMARKS "2 CPU cores, round 7")."""
    return _WIDTH_BUCKET if torch.device(device).type == "cuda" else 1


class _Positions(Protocol):
    ids: list[int]
    positions: list[int]


def _quiet() -> bool:
    from clef_model.env import quiet

    return quiet()


def pad_id(runtime: Runtime) -> int:
    """The id right padding uses (the tokenizer's pad token, else 0: masked out either way)."""
    pad = getattr(runtime.tokenizer, "pad_token_id", None)
    return 0 if pad is None else int(pad)


def padded_batch(batch: Sequence[_Positions], pad: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Right-padded ids and mask (CPU) of ``batch`` and the flat (row × width + position) indices of each
    sequence's kept positions, in order.

    The padded width is rounded up to a multiple of ``bucket`` (:func:`width_bucket` of the device). Right
    padding cannot change the kept positions: every mixer is causal."""
    width = -(-max(len(s.ids) for s in batch) // bucket) * bucket
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    flat: list[int] = []
    for row, seq in enumerate(batch):
        ids[row, : len(seq.ids)] = torch.tensor(seq.ids, dtype=torch.long)
        mask[row, : len(seq.ids)] = 1
        flat.extend(row * width + p for p in seq.positions)
    return ids, mask, flat


def forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """One forward pass whose outputs the hooks read (no KV cache where the model takes the flag); it ends
    early when the collector's hook on the last layer read stops it."""
    try:
        try:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        except TypeError:
            model(input_ids=ids, attention_mask=mask)
    except _PassDone:
        pass


def _run(runtime, collector: _Collector, sequences: list[_Sequence], mode: str, batch_size: int,
         desc: str, progress: bool) -> None:
    if not sequences:
        return
    collector.mode = mode
    pad = pad_id(runtime)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].ids))
    model = runtime.text_model()
    bar = tqdm(total=len(sequences), desc=desc, unit="seq", disable=not progress or _quiet())
    bucket = width_bucket(runtime.device)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = [sequences[i] for i in order[start : start + batch_size]]
            ids, mask, flat = padded_batch(batch, pad, bucket)
            pair = [seq.pair for seq in batch for _ in seq.positions]
            side = [seq.side for seq in batch for _ in seq.positions]
            dev = collector.device
            collector.flat = torch.tensor(flat, dtype=torch.long, device=dev)
            collector.pair = torch.tensor(pair, dtype=torch.long, device=dev)
            collector.side = torch.tensor(side, dtype=torch.long, device=dev)
            forward(model, ids.to(runtime.device), mask.to(runtime.device))
            bar.update(len(batch))
    bar.close()


def collect(
    runtime: Runtime,
    pairs: Sequence[ContrastPair],
    preserve: PreserveSet | None,
    targets: Iterable[str],
    *,
    residual_layers: Iterable[int] | None = None,
    batch_size: int = STATISTICS_BATCH,
    max_length: int = 1024,
    progress: bool = True,
    positions: str = "response",
) -> Statistics:
    """Run the decoder over the contrast pairs and the preserve set and return :class:`Statistics`.

    ``targets`` may be empty (residual means only, e.g. to choose layers first). ``residual_layers``
    defaults to every layer.
    """
    pairs = list(pairs)
    if not pairs:
        raise BlazeError("no contrast pairs: the behaviour spec has no training pairs")
    targets = list(targets)
    n_layers = len(runtime.decoder_layers())
    residual_layers = list(range(n_layers)) if residual_layers is None else sorted(set(residual_layers))
    device = torch.device(runtime.device)
    acc = torch.float32 if device.type == "cuda" else torch.float64
    # sequences first: an error there (e.g. requests on a non-Clef model) must not leave hooks behind
    behaviour = contrast_sequences(runtime, pairs, max_length, positions)
    kept = preserve_sequences(runtime, preserve, max_length) if preserve and targets else []
    collector = _Collector(runtime, targets, len(pairs), residual_layers, acc, device)
    try:
        _run(runtime, collector, behaviour, "behaviour", batch_size, "statistics: contrast pairs", progress)
        _run(runtime, collector, kept, "preserve", batch_size, "statistics: preserve set", progress)
    finally:
        collector.close()

    counts = torch.zeros(2 * len(pairs), dtype=acc, device=device)
    for seq in behaviour:
        counts[seq.side * len(pairs) + seq.pair] += len(seq.positions)
    denom = counts.clamp(min=1).unsqueeze(1)
    n = len(pairs)
    wanted, unwanted = {}, {}
    for layer, sums in collector.res_sum.items():
        means = (sums / denom).float()
        wanted[layer], unwanted[layer] = means[:n], means[n:]
    keys: dict[str, KeyStats] = {}
    for name in targets:
        a = collector.key.get(name)
        if a is None or a["b_n"] == 0:
            raise BlazeError(f"target {name} saw no behaviour tokens: the contrast pairs are empty")
        side_means = a["pair_sum"] / denom
        pair_counts = counts[:n] + counts[n:]
        pair_means = (a["pair_sum"][:n] + a["pair_sum"][n:]) / pair_counts.clamp(min=1).unsqueeze(1)
        ks = KeyStats(
            behaviour_mean=a["b_sum"] / a["b_n"],
            behaviour_moment=a["b_mom"] / a["b_n"],
            behaviour_count=int(a["b_n"]),
            pair_means=pair_means,
            pair_counts=pair_counts,
            wanted_means=side_means[:n],
            unwanted_means=side_means[n:],
        )
        if a["p_n"]:
            ks.preserve_moment = a["p_mom"] / a["p_n"]
            ks.preserve_count = int(a["p_n"])
        keys[name] = ks
    meta = {
        "n_pairs": n,
        "behaviour_tokens": int(counts.sum().item()),
        "preserve_texts": len(preserve.texts) if preserve else 0,
        "preserve_requests": len(preserve.requests) if preserve else 0,
        "preserve_tokens": sum(len(s.positions) for s in kept),
        "num_layers": n_layers,
        "accumulate_dtype": str(acc).replace("torch.", ""),
        "positions": positions,
    }
    return Statistics(
        wanted_means=wanted,
        unwanted_means=unwanted,
        pair_direction=torch.tensor([p.direction for p in pairs], dtype=torch.long),
        keys=keys,
        meta=meta,
    )
