"""Targets: layer specs, kinds, tensor names per architecture; nothing outside the decoder is targeted."""

import pytest

from clef_model.errors import BlazeError
from surgery.targets import (
    KIND_GROUPS,
    layer_count,
    layer_types,
    parse_kinds,
    parse_layers,
    resolve_targets,
    split_name,
    target_names,
)


def test_parse_layers_forms():
    assert parse_layers("8-24", 32) == list(range(8, 25))
    assert parse_layers("3,5,7", 32) == [3, 5, 7]
    assert parse_layers("2-4,10", 32) == [2, 3, 4, 10]
    assert parse_layers("auto", 32) == "auto"
    assert parse_layers(" AUTO ", 8) == "auto"
    # fractions of the depth (31 = last layer), rounded, inclusive
    assert parse_layers("0.4-0.8", 32) == list(range(12, 26))
    assert parse_layers("0-1", 4) == [0, 1]          # integers, not fractions
    assert parse_layers("0.0-1.0", 4) == [0, 1, 2, 3]
    assert parse_layers([5, 1, 1], 8) == [1, 5]


@pytest.mark.parametrize("spec", ["0-32", "40", "5-3", "x", "", "1.5", "-1"])
def test_parse_layers_rejects(spec):
    with pytest.raises(BlazeError):
        parse_layers(spec, 32)


def test_out_of_range_message_names_the_range():
    with pytest.raises(BlazeError, match="0-31"):
        parse_layers("30-33", 32)


def test_qwen3_5_names_follow_layer_types():
    names = target_names("qwen3_5", 8, [2, 3], "writers")
    assert names == [
        "model.language_model.layers.2.linear_attn.out_proj",
        "model.language_model.layers.2.mlp.down_proj",
        "model.language_model.layers.3.self_attn.o_proj",
        "model.language_model.layers.3.mlp.down_proj",
    ]
    readers = target_names("qwen3_5", 8, [3], "readers")
    assert "model.language_model.layers.3.self_attn.q_proj" in readers
    assert not any("linear_attn" in n for n in readers)
    assert target_names("qwen3_5_text", 8, [0], "down_proj") == ["model.layers.0.mlp.down_proj"]


def test_llama_and_kinds():
    assert target_names("llama", 4, [1], "writers") == ["model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"]
    every = target_names("qwen2", 4, [0], "all")
    assert len(every) == 2 + 5  # o, down + q, k, v, gate, up
    assert parse_kinds("writers,mlp.up_proj") == KIND_GROUPS["writers"] + ["mlp.up_proj"]
    with pytest.raises(BlazeError, match="unknown target kind"):
        parse_kinds("lm_head")
    with pytest.raises(BlazeError):
        target_names("gpt2", 4, [0], "writers")


def test_never_targets_embeddings_head_norms_vision():
    names = target_names("qwen3_5", 32, range(32), "all")
    for bad in ("embed", "lm_head", "norm", "visual", "mtp"):
        assert not any(bad in n for n in names)


def test_resolve_targets_keeps_existing_and_errors_when_none():
    have = ["model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"]
    assert resolve_targets(have, "llama", 2, [0], "writers") == ["model.layers.0.self_attn.o_proj",
                                                                 "model.layers.0.mlp.down_proj"]
    with pytest.raises(BlazeError):
        resolve_targets(have, "llama", 2, [1], "writers")


def test_layer_count_and_types(tmp_path):
    assert layer_count({"text_config": {"num_hidden_layers": 32}}) == 32
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30}')
    assert layer_count(tmp_path) == 30
    cfg = {"text_config": {"layer_types": ["full_attention"] * 4}}
    assert layer_types("qwen3_5", 4, cfg) == ["full_attention"] * 4
    assert layer_types("qwen3_5", 4)[3] == "full_attention" and layer_types("qwen3_5", 4)[0] == "linear_attention"
    assert split_name("model.language_model.layers.12.mlp.down_proj.weight") == (12, "mlp.down_proj")
