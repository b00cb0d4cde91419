"""`clef_model.greedy`: the decode that drops stopped answers from the batch gives transformers' own greedy tokens."""

from __future__ import annotations

import pytest
import torch

from clef_model.greedy import greedy_pruned, left_padded


@pytest.fixture(scope="module")
def tiny_llama():
    """A random 2-layer Llama in float64 (so no answer sits on a rounding tie), vocabulary 97."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).to(torch.float64).eval()


PROMPTS = [[5, 9, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40], [12, 13, 14, 15, 16], [60, 61]]


def _reference(model, encoded, max_new_tokens, stops, pad=0):
    """transformers' `generate`, greedy, left padding: each row's new tokens up to its first stop, inclusive."""
    ids, mask = left_padded(encoded, pad)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=stops or None, pad_token_id=pad, use_cache=True)
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        end = next((k for k, token in enumerate(row) if token in stops), None)
        rows.append(row if end is None else row[: end + 1])
    return rows


def _stops_at_different_steps(model) -> list[int]:
    """Tokens that end three of the prompts' answers at three different steps (read off an unstopped run)."""
    free = _reference(model, PROMPTS, 12, [])
    stops: list[int] = []
    for row, step in ((0, 2), (1, 5), (3, 8)):
        if free[row][step] not in stops:
            stops.append(free[row][step])
    return stops


def test_left_padding_right_aligns_each_row():
    ids, mask = left_padded([[1, 2, 3], [4]], pad=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_same_tokens_as_generate_while_rows_leave_the_batch(tiny_llama):
    stops = _stops_at_different_steps(tiny_llama)
    expected = _reference(tiny_llama, PROMPTS, 12, stops)
    lengths = sorted(len(row) for row in expected)
    assert len(set(lengths)) >= 3 and lengths[0] < 12        # rows really stop at different steps
    with torch.inference_mode():
        got = greedy_pruned(tiny_llama, PROMPTS, 12, stops, 0, "cpu")
    assert got == expected


def test_no_stop_runs_every_row_to_the_limit(tiny_llama):
    with torch.inference_mode():
        got = greedy_pruned(tiny_llama, PROMPTS, 7, [], 0, "cpu")
    assert got == _reference(tiny_llama, PROMPTS, 7, []) and all(len(row) == 7 for row in got)


def test_a_cache_that_cannot_drop_rows_keeps_them_and_still_agrees(tiny_llama, monkeypatch):
    from transformers import DynamicCache

    stops = _stops_at_different_steps(tiny_llama)
    monkeypatch.setattr(DynamicCache, "batch_select_indices", None)   # as a cache class without the method
    with torch.inference_mode():
        got = greedy_pruned(tiny_llama, PROMPTS, 12, stops, 0, "cpu")
    assert got == _reference(tiny_llama, PROMPTS, 12, stops)


def test_a_hybrid_cache_layer_keeps_its_rows_and_still_agrees(tiny_llama, monkeypatch):
    """Only plain key/value cache layers lose rows: any other layer type (a hybrid model's linear-attention
    states) keeps the batch whole, and the answers are still transformers' own."""
    import clef_model.greedy as greedy

    stops = _stops_at_different_steps(tiny_llama)
    monkeypatch.setattr(greedy, "_plain_layers", lambda: ())
    with torch.inference_mode():
        got = greedy_pruned(tiny_llama, PROMPTS, 12, stops, 0, "cpu")
    assert got == _reference(tiny_llama, PROMPTS, 12, stops)


def test_only_plain_key_value_layers_count_as_droppable():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    from clef_model.greedy import can_drop_rows

    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicLayer()]
    assert can_drop_rows(cache)
    cache.layers.append(type("LinearStates", (DynamicLayer,), {})())   # a subclass with more state: not trusted
    assert not can_drop_rows(cache)
    assert not can_drop_rows(object())


def test_dropping_a_row_without_its_cache_rows_would_be_caught(tiny_llama, monkeypatch):
    """The test above can fail: a cache that forgets to drop the stopped rows' keys misaligns the batch."""
    from transformers import DynamicCache

    stops = _stops_at_different_steps(tiny_llama)
    monkeypatch.setattr(DynamicCache, "batch_select_indices", lambda self, indices: None)
    with pytest.raises(Exception):  # noqa: B017 - any shape error from the mismatched cache
        with torch.inference_mode():
            greedy_pruned(tiny_llama, PROMPTS, 12, stops, 0, "cpu")


@pytest.mark.slow
def test_runtime_generate_on_smollm2_matches_transformers_generate(smollm2_path, monkeypatch):
    """The real model: `Runtime.generate` (pruned decode, batch of 16) against `BLAZE_FAST=0` (transformers)."""
    from clef_model.runtime import Runtime
    from variants.spec import load_behavior

    runtime = Runtime.load(str(smollm2_path), device="cpu", dtype=torch.float32)
    prompts = [q["prompt"] for q in load_behavior("verbosity").training_questions()][:16]
    fast = runtime.generate(prompts, max_new_tokens=48, batch_size=16)
    monkeypatch.setenv("BLAZE_FAST", "0")
    reference = runtime.generate(prompts, max_new_tokens=48, batch_size=16)
    assert [g.token_ids for g in fast] == [g.token_ids for g in reference]
    assert len({g.new_tokens for g in fast}) > 3   # answers of many lengths: rows left the batch at many steps
