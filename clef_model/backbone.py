"""Where a loaded model keeps its text decoder: the one lookup that the runtime, the fast paths and the
GPU benchmarks share.

Why one place: a Qwen3.5 ``ConditionalGeneration`` model keeps the decoder at ``model.language_model``,
a plain causal LM at ``model``, and a PEFT wrapper hides either behind ``get_base_model()``. Each reader
used to spell that out itself, in slightly different ways.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is only needed for the annotations
    import torch


def text_decoder(model: torch.nn.Module) -> Any:
    """The decoder stack (embeddings, layers, final norm) of a causal LM or a Qwen3.5 multimodal model.

    Typed ``Any``: its submodules (``layers``, ``embed_tokens``, ``norm``) are built by transformers at run time.

    Its forward takes ``input_ids`` (and ``attention_mask``) and returns the final hidden states, without
    the language-model head. A PEFT-wrapped model is unwrapped first.
    """
    base: Any = model  # transformers' submodules are attributes torch can only type as Tensor | Module
    if hasattr(base, "get_base_model"):  # a peft wrapper
        base = base.get_base_model()
    inner = base.model
    return getattr(inner, "language_model", inner)
