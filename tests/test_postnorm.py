"""Writers normalised before the residual (Gemma 3): the residual-to-output map makes a steer edit move the
residual stream by what it was calibrated for, through transformers' own Gemma 3 layer."""

from __future__ import annotations

import types

import pytest
import torch

from surgery.postnorm import inverse_scale, norm_gain, output_scales

gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")


def _layer(seed: int = 0) -> torch.nn.Module:
    """A Gemma 3 decoder layer of a tiny config, with norm gains spread like the real model's (median about 8, up to hundreds)."""
    from transformers import Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=32, num_hidden_layers=1, vocab_size=128)
    layer = gemma3.Gemma3DecoderLayer(config, 0).double()
    with torch.no_grad():
        for norm in (layer.post_feedforward_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(torch.exp(torch.randn(64).double() * 1.2 + 2) - 1)   # Gemma multiplies by 1 + w
    return layer


def _residual_change(norm: torch.nn.Module, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return norm(y + delta) - norm(y)


def test_the_map_turns_a_wanted_residual_change_into_the_writers_output_change():
    """Through Gemma 3's post-feed-forward norm, a raw change δ = t of down_proj's output reaches the residual
    scaled by hundreds and bent away from t; δ = s ⊙ t (the map) reaches it as about t."""
    layer = _layer()
    down, norm = layer.mlp.down_proj, layer.post_feedforward_layernorm
    keys = torch.randn(400, 96, dtype=torch.float64) * 0.05
    moment = keys.T @ keys / keys.shape[0]
    gain = norm_gain(norm, 64, torch.device("cpu"), torch.float64)
    assert torch.allclose(gain, 1 + norm.weight.double(), rtol=1e-4, atol=1e-5)     # read from the module: Gemma's 1 + w
    scale = inverse_scale(gain, down.weight, moment)
    torch.manual_seed(1)
    target = torch.randn(64, dtype=torch.float64)
    target = target / target.norm() * 1e-3
    mapped_cos, raw_cos, mapped_ratio, raw_ratio = [], [], [], []
    for k in keys[:50]:
        y = down(k)
        for delta, cos, ratio in ((scale * target, mapped_cos, mapped_ratio), (target, raw_cos, raw_ratio)):
            change = _residual_change(norm, y, delta)
            cos.append(float(torch.nn.functional.cosine_similarity(change, target, dim=0)))
            ratio.append(float(change.norm() / target.norm()))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(mapped_cos) > 0.85 and 0.5 < mean(mapped_ratio) < 2.0
    assert mean(raw_cos) < 0.75 and mean(raw_ratio) > 20


def test_output_scales_cover_the_normalised_writers_only():
    """For a Gemma 3 model every o_proj and down_proj target gets a map; other targets and other architectures
    get none (their writers add to the residual as they are)."""
    layer = _layer()
    names = {"model.layers.0.mlp.down_proj": layer.mlp.down_proj, "model.layers.0.self_attn.o_proj": layer.self_attn.o_proj,
             "model.layers.0.mlp.up_proj": layer.mlp.up_proj}
    runtime = types.SimpleNamespace(release=types.SimpleNamespace(architecture="gemma3"),
                                    decoder_layers=lambda: [layer], named_linears=lambda: names)
    moments = {n: torch.eye(m.in_features, dtype=torch.float64) for n, m in names.items()}
    scales = output_scales(runtime, list(names), moments)
    assert set(scales) == {"model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"}
    assert all(s.shape == (64,) and torch.isfinite(s).all() for s in scales.values())
    runtime.release.architecture = "llama"
    assert output_scales(runtime, list(names), moments) == {}


def test_a_near_zero_gain_does_not_blow_the_output_change_up():
    """The damped inverse: a dimension whose gain is ~0 (the residual cannot be moved through it) gets a small
    output change, not a huge one."""
    gain = torch.tensor([10.0, 10.0, 1e-9, -10.0], dtype=torch.float64)
    scale = inverse_scale(gain, torch.eye(4, dtype=torch.float64), torch.eye(4, dtype=torch.float64))
    assert abs(float(scale[2])) < 1e-6 and float(scale[0]) == pytest.approx(10 / 101, rel=1e-6)
    assert float(scale[3]) == pytest.approx(-float(scale[0]))
