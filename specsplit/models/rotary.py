"""Rotary position embedding (RoPE) with the scalings transformers implements for Llama-style models.

Frequencies are computed the way transformers computes them (`modeling_rope_utils`: default, linear,
llama3), in float32, so our cos/sin tables are bit-identical to the oracle's.
"""

from __future__ import annotations

import math

import torch

from specsplit.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[rotary_dim // 2] float32 inverse frequencies, on the host."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {scaling['rope_type']!r}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Turns positions into (cos, sin) tables; `apply_rotary` rotates q and k with them.

    Deliberately not an `nn.Module` buffer: `model.to(torch.bfloat16)` must not round the frequencies.
    """

    def __init__(self, config: ModelConfig) -> None:
        self._inv_freq = rope_inv_freq(config)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 → cos, sin: [T, rotary_dim] in `dtype`
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, num_heads, head_dim], cos/sin: [T, rotary_dim] → [T, num_heads, head_dim]
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:  # partial rotary (GLM-4.5): rotate-half on the first rotary_dim, the rest passes
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
