"""Writers whose output is normalised before it joins the residual stream (Gemma 2/3's "sandwich" norms).

``steer`` and ``nullspace`` are calibrated in the residual stream: at strength α each edited layer moves it by
α × the layer's contrastive mean difference, and the writer's ΔW is built along those residual directions
(docs/METHOD.md, "Strength"). That holds where a writer's output is added to the residual as it is (Llama,
Qwen2, Qwen3.5). In Gemma 3 each ``o_proj`` and ``down_proj`` output y first passes an RMSNorm with a learned
gain g (``post_attention_layernorm``, ``post_feedforward_layernorm``), so a change δ of y reaches the residual
as about g ⊙ δ / rms(y). Measured on Gemma 3 270M (three layers, a change along a random direction): the
residual moved 24 to 2,480 times as far as δ, and its direction kept a cosine of only 0.24-0.82 with δ, while
g ⊙ δ / rms(y) matched it (cosine 0.83-1.00). Without this map a steer edit on that model was a hundred times
too strong and pointed elsewhere: every strength down to 0.0004 damaged it (BENCHMARKS "One H200, round 6").

:func:`output_scales` gives, per such writer, the vector s with δ = s ⊙ t for a wanted residual change t,
the inverse of that linear map: s = rms(y) · g / (g² + ε²), a damped inverse so a near-zero gain does not blow
up (ε is :data:`GAIN_FLOOR` × the median |g|). rms(y) is over the behaviour keys, from the key moment and W:
E‖y‖² = tr(W E[k kᵀ] Wᵀ). The solver multiplies the writer's output factor U by s after calibration.
The map is linear around the typical output scale; the part of δ along y itself is normalised away, which the
strength search absorbs. ``distill`` needs none of this: it fits the writer's own output change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from surgery.targets import split_name

if TYPE_CHECKING:
    from clef_model.runtime import Runtime

#: Per architecture: writer kind -> the attribute of its decoder layer that normalises the writer's output.
POST_NORMS: dict[str, dict[str, str]] = {
    "gemma3": {"self_attn.o_proj": "post_attention_layernorm", "mlp.down_proj": "post_feedforward_layernorm"},
}
MAP_VERSION = 1
"""Bumped when the map changes: statistics fingerprints of such models hold it (with GAIN_FLOOR), so scales
cached under another version are collected again."""
GAIN_FLOOR = 0.1
"""ε of the damped inverse, as a fraction of the median |g|: dimensions whose gain is below it are moved less
than asked instead of by a huge output change (Gemma 3 270M has gains from -1.1 to 741)."""


def has_post_norms(architecture: str) -> bool:
    """Whether the writers of ``architecture`` are normalised before the residual (the map is needed)."""
    return architecture in POST_NORMS


def norm_gain(norm: torch.nn.Module, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The per-dimension gain g of an RMS norm: its output for an input of RMS 1 (all ones). Read from the
    module itself, so the weight convention (Gemma's 1 + w, Llama's w) does not matter."""
    with torch.no_grad():
        return norm(torch.ones(1, width, device=device, dtype=dtype))[0].double()


def inverse_scale(gain: torch.Tensor, weight: torch.Tensor, key_moment: torch.Tensor) -> torch.Tensor:
    """s = rms(y) · g / (g² + ε²) for a writer of weight W (d_out × d_in) with key moment E[k kᵀ] (d_in × d_in)."""
    w = weight.float()    # float32 products, float64 sum: the d_in² moment is not copied to float64 on a GPU
    energy = ((w @ key_moment.float()) * w).double().sum().clamp(min=0.0)
    rms = torch.sqrt(energy / w.shape[0])
    gain = gain.double()
    floor = GAIN_FLOOR * gain.abs().median()
    return rms * gain / (gain * gain + floor * floor)


def output_scales(runtime: Runtime, targets: Iterable[str], key_moments: Mapping[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """:func:`inverse_scale` of every target writer of ``runtime`` whose output is normalised before the
    residual ({} for an architecture without such norms); ``key_moments`` are the targets' E[k kᵀ]."""
    norms = POST_NORMS.get(runtime.release.architecture, {})
    if not norms:
        return {}
    layers = runtime.decoder_layers()
    linears = runtime.named_linears()
    out: dict[str, torch.Tensor] = {}
    for name in targets:
        layer, kind = split_name(name)
        if kind not in norms:
            continue
        weight = linears[name].weight.detach()
        gain = norm_gain(getattr(layers[layer], norms[kind]), weight.shape[0], weight.device, weight.dtype)
        out[name] = inverse_scale(gain, weight, key_moments[name].to(weight.device)).float().cpu()
    return out
