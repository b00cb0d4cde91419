"""`blaze fixture --preset 27b`: Qwen3.5-27B's layout, checked on the meta device (no weights written).

The expected figures are computed here from the published config values (64 layers, 3 Gated DeltaNet :
1 full attention, hidden 5120, MLP 17408, 24 × 256 query heads with an output gate, 4 KV heads, linear
attention 16 key / 48 value heads of 128, conv kernel 4, vocabulary 248320), independently of the
fixture builder, and compared with the tensors the builder would write.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from clef_model.fixtures import PRESETS, fixture_layout

HIDDEN, MLP, LAYERS, VOCAB = 5120, 17408, 64, 248320
HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 16, 48, 128, 128, 4


def _full_attention_params() -> int:
    q = HIDDEN * HEADS * HEAD_DIM * 2  # query and its output gate in one projection
    kv = 2 * HIDDEN * KV_HEADS * HEAD_DIM
    o = HEADS * HEAD_DIM * HIDDEN
    return q + kv + o + 2 * HEAD_DIM  # + q_norm, k_norm


def _linear_attention_params() -> int:
    conv_dim = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
    return (HIDDEN * conv_dim + HIDDEN * V_HEADS * V_DIM + 2 * HIDDEN * V_HEADS  # in_proj_qkv, _z, _b, _a
            + conv_dim * CONV + V_HEADS * V_DIM * HIDDEN + 2 * V_HEADS + V_DIM)  # conv, out_proj, dt/A, norm


def _text_params() -> int:
    layer_common = 3 * HIDDEN * MLP + 2 * HIDDEN  # MLP + two norms
    full = LAYERS // 4
    return (2 * VOCAB * HIDDEN + HIDDEN  # embed, lm_head, final norm
            + LAYERS * layer_common + full * _full_attention_params() + (LAYERS - full) * _linear_attention_params())


@pytest.fixture(scope="module")
def layout() -> list[tuple[str, str, tuple[int, ...]]]:
    return fixture_layout("27b")


def test_27b_is_a_preset() -> None:
    from variants.cli.fixture import fixture

    assert "27b" in PRESETS
    preset = next(p for p in fixture.params if p.name == "preset")
    assert "27b" in preset.type.choices  # type: ignore[attr-defined]


def test_text_backbone_matches_the_published_config(layout) -> None:
    text = {name: shape for name, _, shape in layout if name.startswith(("model.language_model.", "lm_head"))}
    assert sum(math.prod(s) for s in text.values()) == _text_params()
    assert text["lm_head.weight"] == (VOCAB, HIDDEN)
    full = sorted({int(n.split(".")[3]) for n in text if ".self_attn." in n})
    assert full == list(range(3, LAYERS, 4))  # every 4th layer full attention, the other 48 Gated DeltaNet
    linear = {int(n.split(".")[3]) for n in text if ".linear_attn." in n}
    assert len(linear) == 48 and not linear & set(full)
    assert text["model.language_model.layers.3.self_attn.q_proj.weight"] == (2 * HEADS * HEAD_DIM, HIDDEN)
    assert text["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == (
        2 * K_HEADS * K_DIM + V_HEADS * V_DIM, HIDDEN)
    assert text["model.language_model.layers.0.mlp.down_proj.weight"] == (HIDDEN, MLP)


def test_about_27b_parameters_and_55_gb(layout) -> None:
    groups: Counter[str] = Counter()
    size = 0
    for name, dtype, shape in layout:
        part = "vision" if ".visual." in name else "mtp" if name.startswith("mtp.") else "text"
        groups[part] += math.prod(shape)
        size += math.prod(shape) * {"BF16": 2, "F32": 4}[dtype]
    assert 26.5e9 < groups["text"] < 27.5e9  # 26.90B: the "27B" of the name
    assert 0.40e9 < groups["vision"] < 0.50e9  # 27 blocks of width 1152 + merger to 5120
    assert 0.35e9 < groups["mtp"] < 0.50e9  # one full-attention MTP layer + its projections
    assert 55.0e9 < size < 56.0e9  # bytes on disk: too large to sit twice on a 64 GiB disk


def test_layers_can_be_cut_for_benchmarks() -> None:
    eight = fixture_layout("27b", num_layers=8)
    assert max(int(n.split(".")[3]) for n, _, _ in eight if n.startswith("model.language_model.layers.")) == 7
