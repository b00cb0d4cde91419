"""Small tensor operations of the Qwen3.5 forward that the fast engine spells out itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_eps(norm: torch.nn.Module) -> float:
    """The epsilon of a transformers RMSNorm module (its attribute name varies between classes)."""
    for name in ("eps", "variance_epsilon"):
        value = getattr(norm, name, None)
        if value is not None:
            return float(value)
    return 1e-6


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` scaled to unit L2 norm over its last dimension (the delta rule's query/key normalisation)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of ``x [B, C, T]`` with ``weight [C, K]`` as K shifted multiply-adds (float32)."""
    kernel, t = weight.shape[-1], x.shape[-1]
    padded = F.pad(x, (kernel - 1, 0)).float()
    w = weight.float()
    out = padded[..., kernel - 1 : kernel - 1 + t] * w[:, kernel - 1 : kernel]
    for j in range(kernel - 1):
        out = out + padded[..., j : j + t] * w[:, j : j + 1]
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` for ``x = (x1, x2)`` split in halves: the rotary embedding's rotation."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
