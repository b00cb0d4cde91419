"""Which models the fast paths run, and the shapes and kernels they run them with.

The fast paths handle Qwen3.5 hybrid text backbones (Gated DeltaNet and full-attention layers); anything
else goes to the reference path. flash-linear-attention's kernels are optional: each lookup answers None
when the package is missing, and the engine then uses its float32 torch recurrence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from clef_model.backbone import text_decoder
from clef_model.errors import BlazeError


def text_parts(model: torch.nn.Module) -> tuple[Any, Any]:
    """Return ``(decoder stack, lm_head)`` of a Qwen3.5 CausalLM or ConditionalGeneration model.

    Typed ``Any``: transformers builds these modules' attributes (``config``, ``layers``, ``embed_tokens``,
    ``weight``) at run time, which ``torch.nn.Module.__getattr__`` can only type as ``Tensor | Module``.
    """
    base: Any = model
    if hasattr(base, "get_base_model"):  # a peft wrapper
        base = base.get_base_model()
    text = text_decoder(base)
    if not hasattr(text, "layers") or not hasattr(text, "embed_tokens"):
        raise BlazeError(
            f"fast path: {type(model).__name__} has no Qwen3.5 decoder stack; use the reference path"
        )
    return text, base.get_output_embeddings()


def is_supported(model: torch.nn.Module) -> bool:
    """True when ``model`` is a Qwen3.5 text backbone this module can run (hybrid DeltaNet/attention)."""
    try:
        text, _ = text_parts(model)
    except BlazeError:
        return False
    types = set(getattr(text.config, "layer_types", None) or ())
    # a hybrid: plain attention models (Qwen2 also lists its layers as "full_attention") take other paths
    return "linear_attention" in types and types <= {"linear_attention", "full_attention"}


def fla_kernel(name: str) -> Callable | None:
    """A flash-linear-attention gated-delta-rule kernel (``chunk_…`` or ``fused_recurrent_…``), or None."""
    try:
        from fla.ops import gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return getattr(gated_delta_rule, f"{name}_gated_delta_rule", None)


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    layer_types: tuple[str, ...]


def dims_of(text: Any) -> Dims:
    """The shapes of a Qwen3.5 text decoder stack (``text``: the first item of :func:`text_parts`), from its config."""
    c = text.config
    return Dims(
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        k_heads=c.linear_num_key_heads,
        v_heads=c.linear_num_value_heads,
        k_dim=c.linear_key_head_dim,
        v_dim=c.linear_value_head_dim,
        conv_kernel=c.linear_conv_kernel_dim,
        layer_types=tuple(c.layer_types[: c.num_hidden_layers]),
    )
