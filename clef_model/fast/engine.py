"""The Qwen3.5 text decoder forward, re-implemented over a loaded model's own modules with static shapes.

Same math on the same modules as transformers (so live weight edits such as ``Patch.applied`` are
seen), with shapes fixed in advance so that a whole forward or a whole decode step can be captured as
a CUDA graph (:mod:`clef_model.fast.graphs`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from clef_model.errors import BlazeError
from clef_model.fast.cache import StaticCache
from clef_model.fast.ops import causal_conv, l2norm, rms_eps, rotate_half
from clef_model.fast.support import dims_of, fla_kernel, is_supported, text_parts


class QwenEngine:
    """The Qwen3.5 text decoder forward over a loaded model's own modules, with static shapes.

    Text-only positions make Qwen3.5's multimodal rotary embedding an ordinary partial rotary
    embedding, which is what this computes. ``use_fla`` picks the DeltaNet prefill kernel (default: fla on
    CUDA when importable); the decode step is plain torch so it captures cleanly in a CUDA graph.
    """

    def __init__(self, model: torch.nn.Module, *, use_fla: bool | None = None, fused_norms: bool | None = None,
                 conv: str = "conv1d", fla_decode: bool | None = None) -> None:
        if not is_supported(model):
            raise BlazeError("fast path: model is not a Qwen3.5 hybrid text backbone; use the reference path")
        self.model = model
        self.text, self.lm_head = text_parts(model)
        self.dims = dims_of(self.text)
        self.layers = list(self.text.layers[: len(self.dims.layer_types)])
        weight = self.text.embed_tokens.weight
        self.device: torch.device = weight.device
        self.dtype: torch.dtype = weight.dtype
        chunk = fla_kernel("chunk") if (use_fla is not False and self.device.type == "cuda") else None
        if use_fla and chunk is None:
            raise BlazeError("fast path: use_fla=True but flash-linear-attention is not importable on CUDA")
        self._chunk = chunk
        self._recurrent = fla_kernel("fused_recurrent") if (chunk is not None and fla_decode is not False) else None
        # one fused RMSNorm kernel instead of ~7 elementwise ones: same formula, different bf16 rounding.
        # Off by default: on the 9B fixture it saved 2.5 ms of 39.7 but moved final hidden states by 3.9%
        # (random weights amplify rounding) and changed greedy tokens; the module norms are bit-identical.
        self.fused_norms = False if fused_norms is None else fused_norms
        if conv not in ("conv1d", "shift"):
            raise BlazeError(f"fast path: conv must be 'conv1d' or 'shift' (got {conv!r})")
        self.conv = conv
        rotary = self.text.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().to(device=self.device, dtype=torch.float32)
        self._rope_scale = float(getattr(rotary, "attention_scaling", 1.0))

    @property
    def uses_fla(self) -> bool:
        """Whether the DeltaNet prefill runs flash-linear-attention's kernel."""
        return self._chunk is not None

    def _rms(self, norm: Any, x: torch.Tensor) -> torch.Tensor:
        """Qwen3.5's zero-centred RMSNorm (x · rsqrt(mean x² + eps) · (1 + w), in float32)."""
        if not self.fused_norms:
            return norm(x)
        return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + norm.weight.float(), rms_eps(norm)).to(x.dtype)

    def _gated_norm(self, norm: Any, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Gated DeltaNet's output norm: w · RMSNorm(x) · silu(gate)."""
        if not self.fused_norms:
            return norm(x, gate)
        h = F.rms_norm(x.float(), (x.shape[-1],), None, rms_eps(norm)).to(x.dtype)
        return (norm.weight * h * F.silu(gate.float())).to(x.dtype)

    # -- caches --------------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> StaticCache:
        """Allocate zeroed static caches for ``batch`` rows of up to ``max_len`` positions."""
        d, dev = self.dims, self.device
        conv_dim = 2 * d.k_heads * d.k_dim + d.v_heads * d.v_dim
        keys, values, conv, rec = {}, {}, {}, {}
        for i, kind in enumerate(d.layer_types):
            if kind == "full_attention":
                keys[i] = torch.zeros(batch, d.kv_heads, max_len, d.head_dim, device=dev, dtype=self.dtype)
                values[i] = torch.zeros_like(keys[i])
            else:
                conv[i] = torch.zeros(batch, conv_dim, d.conv_kernel - 1, device=dev, dtype=self.dtype)
                rec[i] = torch.zeros(batch, d.v_heads, d.k_dim, d.v_dim, device=dev, dtype=torch.float32)
        return StaticCache(batch, max_len, keys, values, conv, rec)

    # -- pieces --------------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self._rope_scale).to(self.dtype)
        sin = (emb.sin() * self._rope_scale).to(self.dtype)
        return cos[:, None], sin[:, None]  # [B, 1, T, rot]

    def _qkv(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        b, t, _ = x.shape
        q, gate = torch.chunk(attn.q_proj(x).view(b, t, d.heads, 2 * d.head_dim), 2, dim=-1)
        q = self._rms(attn.q_norm, q).transpose(1, 2)
        k = self._rms(attn.k_norm, attn.k_proj(x).view(b, t, d.kv_heads, d.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, d.kv_heads, d.head_dim).transpose(1, 2)
        rot = cos.shape[-1]
        q = torch.cat((q[..., :rot] * cos + rotate_half(q[..., :rot]) * sin, q[..., rot:]), dim=-1)
        k = torch.cat((k[..., :rot] * cos + rotate_half(k[..., :rot]) * sin, k[..., rot:]), dim=-1)
        return q, k, v, gate.reshape(b, t, d.heads * d.head_dim)

    def _attention(self, attn, x, cos, sin, cache: StaticCache | None, layer: int,
                   step_pos: torch.Tensor | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v, gate = self._qkv(attn, x, cos, sin)
        if step_pos is None:  # prefill / no cache: causal over the given tokens
            if cache is not None:
                cache.keys[layer][:b, :, :t].copy_(k)
                cache.values[layer][:b, :, :t].copy_(v)
            rep = self.dims.heads // self.dims.kv_heads  # expanded K/V keep SDPA on its flash kernel
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1),
                                                 is_causal=True, scale=attn.scaling)
        else:  # one new token per row at step_pos[row]
            assert cache is not None, "a decode step always runs on a cache"
            rows = torch.arange(b, device=x.device)
            cache.keys[layer][rows, :, step_pos] = k[:, :, 0]
            cache.values[layer][rows, :, step_pos] = v[:, :, 0]
            span = torch.arange(cache.max_len, device=x.device)
            mask = (span[None, :] <= step_pos[:, None])[:, None, None, :]
            out = F.scaled_dot_product_attention(
                q, cache.keys[layer][:b], cache.values[layer][:b], attn_mask=mask, scale=attn.scaling,
                enable_gqa=True,
            )
        out = out.transpose(1, 2).reshape(b, t, -1) * torch.sigmoid(gate)
        return attn.o_proj(out)

    def _delta_recurrence(self, q, k, v, g, beta, state):
        """Float32 gated delta rule over T steps (the reference recurrence). Returns (out, state)."""
        d = self.dims
        rep = d.v_heads // d.k_heads
        q = l2norm(q.float()).repeat_interleave(rep, dim=2) / math.sqrt(d.k_dim)
        k = l2norm(k.float()).repeat_interleave(rep, dim=2)
        v, g, beta = v.float(), g.float(), beta.float()
        outs = []
        for i in range(q.shape[1]):
            state = state * g[:, i].exp()[..., None, None]
            kv = (state * k[:, i, :, :, None]).sum(dim=-2)
            delta = (v[:, i] - kv) * beta[:, i, :, None]
            state = state + k[:, i, :, :, None] * delta[:, :, None, :]
            outs.append((state * q[:, i, :, :, None]).sum(dim=-2))
        return torch.stack(outs, dim=1), state

    def _linear(self, la, x, cache: StaticCache | None, layer: int, lengths: torch.Tensor | None,
                step: bool) -> torch.Tensor:
        d = self.dims
        b, t, _ = x.shape
        mixed = la.in_proj_qkv(x).transpose(1, 2)  # [B, C, T]
        z = la.in_proj_z(x)
        beta = la.in_proj_b(x).sigmoid()
        g = -la.A_log.float().exp() * F.softplus(la.in_proj_a(x).float() + la.dt_bias)
        weight = la.conv1d.weight.squeeze(1)  # [C, K]
        kernel = weight.shape[-1]
        if step:
            assert cache is not None, "a decode step always runs on a cache"
            conv_state = cache.conv[layer][:b]
            window = torch.cat((conv_state, mixed), dim=-1)  # [B, C, K]
            conv_state.copy_(window[:, :, 1:])
            conv = F.silu(F.conv1d(window, weight.unsqueeze(1), None, groups=window.shape[1]))
        else:
            if cache is not None:
                padded = F.pad(mixed, (kernel - 1, 0))  # keep the last K-1 real inputs of each row
                ends = (lengths if lengths is not None else torch.full((b,), t, device=x.device)) + kernel - 1
                idx = ends[:, None] - torch.arange(kernel - 1, 0, -1, device=x.device)[None, :]
                cache.conv[layer][:b].copy_(torch.gather(padded, 2, idx[:, None, :].expand(-1, padded.shape[1], -1)))
            if self.conv == "shift":
                conv = F.silu(causal_conv(mixed, weight)).to(x.dtype)
            else:
                conv = F.silu(F.conv1d(mixed, weight.unsqueeze(1), None, padding=kernel - 1,
                                       groups=mixed.shape[1])[..., :t])
        conv = conv.transpose(1, 2)
        q, k, v = torch.split(conv, [d.k_heads * d.k_dim, d.k_heads * d.k_dim, d.v_heads * d.v_dim], dim=-1)
        q = q.reshape(b, t, d.k_heads, d.k_dim)
        k = k.reshape(b, t, d.k_heads, d.k_dim)
        v = v.reshape(b, t, d.v_heads, d.v_dim)
        if lengths is not None:  # right padding: pad steps leave the state untouched (no decay, no write)
            real = (torch.arange(t, device=x.device)[None, :] < lengths[:, None])[..., None]
            g = g * real
            beta = beta * real
        state = cache.recurrent[layer][:b] if (cache is not None and step) else None
        if self._chunk is not None and not step:
            out, final = self._chunk(q, k, v, g=g, beta=beta, initial_state=None,
                                     output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)
        elif self._recurrent is not None and step and self._try_recurrent(q, k, v, g, beta, state):
            out, final = self._recurrent_out  # one fused kernel per layer and step (l2norm, decay, update)
        else:
            init = state if state is not None else torch.zeros(
                b, d.v_heads, d.k_dim, d.v_dim, device=x.device, dtype=torch.float32)
            out, final = self._delta_recurrence(q, k, v, g, beta, init)
        if cache is not None:
            cache.recurrent[layer][:b].copy_(final)
        out = self._gated_norm(la.norm, out.to(x.dtype).reshape(-1, d.v_dim), z.reshape(-1, d.v_dim))
        return la.out_proj(out.reshape(b, t, -1))

    def _try_recurrent(self, q, k, v, g, beta, state) -> bool:
        """Run fla's fused recurrent step; on any error fall back to the torch recurrence for good.

        The first decode step runs eagerly (warm-up before graph capture), so a kernel that does not
        work on this machine is found there, never inside a capture.
        """
        recurrent = self._recurrent
        if recurrent is None:
            return False
        try:
            self._recurrent_out = recurrent(q, k, v, g=g, beta=beta, initial_state=state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
            return True
        except Exception as error:  # noqa: BLE001 - any failure: use the reference recurrence
            import warnings

            warnings.warn(f"fast path: fla fused recurrent step failed ({error}); using the torch recurrence", stacklevel=2)
            self._recurrent = None
            return False

    # -- public forwards -----------------------------------------------------------------------------

    def _run(self, input_ids, positions, cache, lengths, step_pos) -> torch.Tensor:
        h = self.text.embed_tokens(input_ids)
        cos, sin = self._rope(positions)
        for i, (layer, kind) in enumerate(zip(self.layers, self.dims.layer_types, strict=True)):
            y = self._rms(layer.input_layernorm, h)
            if kind == "full_attention":
                y = self._attention(layer.self_attn, y, cos, sin, cache, i, step_pos)
            else:
                y = self._linear(layer.linear_attn, y, cache, i, lengths, step=step_pos is not None)
            h = h + y
            h = h + layer.mlp(self._rms(layer.post_attention_layernorm, h))
        return self._rms(self.text.norm, h)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T, hidden]`` of unpadded (or right-padded) rows, no cache."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        return self._run(input_ids, positions, None, None, None)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """Run right-padded prompts ``[B, T]`` (real lengths ``lengths``) into ``cache``; return the
        logits at each row's last real token ``[B, vocab]``."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        hidden = self._run(input_ids, positions, cache, lengths, None)
        last = hidden[torch.arange(b, device=hidden.device), lengths - 1]
        return self.lm_head(last)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """One decode step: ``tokens [B]`` at ``positions [B]`` -> logits ``[B, vocab]``; updates ``cache``."""
        hidden = self._run(tokens[:, None], positions[:, None], cache, None, positions)
        return self.lm_head(hidden[:, 0])
