"""CUDA-graph replay of the engine: SystemOne backbone per length bucket (batch 1, or a small length-aware
batch of rows), and greedy decoding.

A graph is captured once per shape ((rows, length bucket), or decode batch size) and replayed with one launch,
which removes the Python and kernel-launch overhead that dominates the stock path. On the CPU both
classes run the same engine eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from clef_model.errors import BlazeError
from clef_model.fast.engine import QwenEngine


def default_buckets(limit: int = 4096, granularity: int = 64) -> tuple[int, ...]:
    """Length buckets for padded SystemOne forwards: multiples of ``granularity`` up to ``limit``."""
    return tuple(range(granularity, limit + 1, granularity))


class GraphedBackbone:
    """Batch-1 final hidden states, right-padded to a length bucket; one CUDA graph per bucket.

    Right padding never changes the real positions' hidden states (every mixer is causal), so the
    result equals the unpadded forward up to kernel rounding. Lengths above the largest bucket, and
    every length on CPU, run eagerly without padding.
    """

    def __init__(self, engine: QwenEngine, *, buckets: Sequence[int] = default_buckets(),
                 pad_token_id: int = 0, use_graphs: bool | None = None,
                 pad_to_bucket: bool | None = None) -> None:
        self.engine = engine
        self.buckets = tuple(sorted(buckets))
        self.pad_token_id = pad_token_id
        self.use_graphs = engine.device.type == "cuda" if use_graphs is None else use_graphs
        # padding without graphs only serves tests: it feeds the eager path what a graph would see
        self.pad_to_bucket = self.use_graphs if pad_to_bucket is None else pad_to_bucket
        # keyed by (rows, bucket): batch-1 requests and the small batches of `rows` share one pool
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool: Any = None  # torch.cuda.graph_pool_handle(): an opaque handle torch does not export a type for

    def bucket_for(self, length: int) -> int | None:
        """The smallest bucket holding ``length`` tokens, or None when it is longer than all buckets."""
        for bucket in self.buckets:
            if bucket >= length:
                return bucket
        return None

    def _capture(self, bucket: int, rows: int = 1):
        ids = torch.full((rows, bucket), self.pad_token_id, dtype=torch.long, device=self.engine.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: kernel autotuning and workspace allocation stay out of the graph
                self.engine.hidden_states(ids)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.engine.hidden_states(ids)
        self._graphs[(rows, bucket)] = (graph, ids, out)
        return self._graphs[(rows, bucket)]

    def warm(self, lengths: Sequence[int]) -> None:
        """Capture the graphs for the buckets of ``lengths`` ahead of time."""
        for length in lengths:
            bucket = self.bucket_for(length)
            if self.use_graphs and bucket is not None and (1, bucket) not in self._graphs:
                self._capture(bucket)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[1, T, hidden]`` for one unpadded row ``input_ids [1, T]``."""
        length = input_ids.shape[1]
        bucket = self.bucket_for(length)
        if bucket is None or input_ids.shape[0] != 1 or not (self.use_graphs or self.pad_to_bucket):
            return self.engine.hidden_states(input_ids)
        if not self.use_graphs:
            ids = torch.full((1, bucket), self.pad_token_id, dtype=torch.long, device=input_ids.device)
            ids[:, :length].copy_(input_ids)
            return self.engine.hidden_states(ids)[:, :length]
        graph, ids, out = self._graphs.get((1, bucket)) or self._capture(bucket)
        ids.fill_(self.pad_token_id)
        ids[:, :length].copy_(input_ids)
        graph.replay()
        return out[:, :length]

    @torch.inference_mode()
    def rows(self, input_ids: torch.Tensor, graph_tokens: int = 2048) -> torch.Tensor:
        """Hidden states ``[B, T, hidden]`` for right-padded rows ``input_ids [B, T]`` (a length-aware batch).

        The rows are padded further to the length bucket of ``T`` (bounded set of shapes, as for batch 1).
        A padded batch of at most ``graph_tokens`` tokens replays a CUDA graph captured once per
        (rows, bucket); a larger one runs eagerly, where its long kernels hide their own launches. One
        row takes the batch-1 path. Positions past a row's real length hold padding's hidden states,
        which the joint head never reads (it cuts each row at its attention mask).
        """
        count, length = input_ids.shape
        if count == 1:
            return self(input_ids)
        bucket = self.bucket_for(length)
        if bucket is None or not (self.use_graphs or self.pad_to_bucket):
            return self.engine.hidden_states(input_ids)
        if not self.use_graphs or count * bucket > graph_tokens:
            ids = torch.full((count, bucket), self.pad_token_id, dtype=torch.long, device=input_ids.device)
            ids[:, :length].copy_(input_ids)
            return self.engine.hidden_states(ids)[:, :length]
        graph, ids, out = self._graphs.get((count, bucket)) or self._capture(bucket, count)
        ids.fill_(self.pad_token_id)
        ids[:, :length].copy_(input_ids)
        graph.replay()
        return out[:, :length]


class StaticGreedyDecoder:
    """Greedy decoding over static caches; the decode step is one CUDA graph per batch size.

    ``generate(prompts, max_new_tokens)`` takes token-id lists (any lengths), prefills them right-padded
    in one forward, then replays the captured step ``max_new_tokens - 1`` times. With ``stop_ids`` it
    checks for end-of-sequence every ``check_every`` steps (one host sync each) and cuts each row after
    its first stop token, like ``generate(..., do_sample=False)``.
    """

    def __init__(self, model: torch.nn.Module, *, max_len: int = 4096, use_graphs: bool | None = None,
                 engine: QwenEngine | None = None) -> None:
        self.engine = engine or QwenEngine(model)
        self.max_len = max_len
        self.use_graphs = self.engine.device.type == "cuda" if use_graphs is None else use_graphs
        self._states: dict[int, dict[str, Any]] = {}

    def _state(self, batch: int) -> dict[str, Any]:
        if batch in self._states:
            return self._states[batch]
        dev = self.engine.device
        state = {
            "cache": self.engine.new_cache(batch, self.max_len),
            "tokens": torch.zeros(batch, dtype=torch.long, device=dev),
            "positions": torch.zeros(batch, dtype=torch.long, device=dev),
            "graph": None,
        }
        self._states[batch] = state
        return state

    def _step_inplace(self, state: dict[str, Any]) -> None:
        logits = self.engine.step(state["tokens"], state["positions"], state["cache"])
        state["tokens"].copy_(logits.argmax(dim=-1))
        state["positions"].add_(1)

    def _graph(self, state: dict[str, Any]) -> torch.cuda.CUDAGraph:
        if state["graph"] is None:
            saved = (state["tokens"].clone(), state["positions"].clone(),
                     {k: v.clone() for k, v in state["cache"].conv.items()},
                     {k: v.clone() for k, v in state["cache"].recurrent.items()})
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step_inplace(state)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step_inplace(state)
            # warm-up and capture ran real steps: restore the state they advanced
            state["tokens"].copy_(saved[0])
            state["positions"].copy_(saved[1])
            for k, v in saved[2].items():
                state["cache"].conv[k].copy_(v)
            for k, v in saved[3].items():
                state["cache"].recurrent[k].copy_(v)
            state["graph"] = graph
        return state["graph"]

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 stop_ids: Sequence[int] = (), check_every: int = 16) -> list[list[int]]:
        """Greedy continuations (new token ids only) of ``prompts``; at most ``max_new_tokens`` each."""
        if not prompts:
            return []
        batch = len(prompts)
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise BlazeError("fast generate: every prompt needs at least one token")
        if longest + max_new_tokens > self.max_len:
            raise BlazeError(
                f"fast generate: prompt ({longest}) + new tokens ({max_new_tokens}) exceed max_len "
                f"{self.max_len}; build the decoder with a larger max_len"
            )
        dev = self.engine.device
        state = self._state(batch)
        ids = torch.zeros(batch, longest, dtype=torch.long, device=dev)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
        logits = self.engine.prefill(ids, lengths, state["cache"])
        state["tokens"].copy_(logits.argmax(dim=-1))
        state["positions"].copy_(lengths)
        out = torch.empty(batch, max_new_tokens, dtype=torch.long, device=dev)
        out[:, 0] = state["tokens"]
        graph = self._graph(state) if self.use_graphs else None
        stops = torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
        done_at = max_new_tokens
        for i in range(1, max_new_tokens):
            if stops.numel() and i % check_every == 0:
                if bool(torch.isin(out[:, :i], stops).any(dim=1).all()):
                    done_at = i
                    break
            if graph is not None:
                graph.replay()
            else:
                self._step_inplace(state)
            out[:, i] = state["tokens"]
        rows = out[:, :done_at].tolist()
        stop_set = set(int(s) for s in stop_ids)
        result = []
        for row in rows:
            cut = next((j + 1 for j, tok in enumerate(row) if tok in stop_set), len(row))
            result.append(row[:cut])
        return result
