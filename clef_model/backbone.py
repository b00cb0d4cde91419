"""Where a loaded model keeps its text decoder: the one lookup that the runtime, the fast paths and the
GPU benchmarks share.

Why one place: a Qwen3.5 ``ConditionalGeneration`` model keeps the decoder at ``model.language_model``,
a plain causal LM at ``model``, and a PEFT wrapper hides either behind ``get_base_model()``. Each reader
used to spell that out itself, in slightly different ways.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is only needed for the annotations
    import torch


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embeddings, layers, final norm) of a causal LM or a Qwen3.5 multimodal model.

    Its forward takes ``input_ids`` (and ``attention_mask``) and returns the final hidden states, without
    the language-model head. A PEFT-wrapped model is unwrapped first.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    return getattr(inner, "language_model", inner)
