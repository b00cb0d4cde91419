"""The static decode state of :class:`~clef_model.fast.engine.QwenEngine`: buffers allocated once.

Fixed shapes are what let a decode step be captured as a CUDA graph and replayed: the graph writes into
the same tensors on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StaticCache:
    """Fixed-size decode state for ``batch`` rows and up to ``max_len`` positions.

    ``keys``/``values``: per full-attention layer ``[batch, kv_heads, max_len, head_dim]``;
    ``conv``: per linear layer the last ``kernel-1`` conv inputs ``[batch, conv_dim, kernel-1]``;
    ``recurrent``: per linear layer the float32 delta-rule state ``[batch, v_heads, k_dim, v_dim]``.
    """

    batch: int
    max_len: int
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    recurrent: dict[int, torch.Tensor]
