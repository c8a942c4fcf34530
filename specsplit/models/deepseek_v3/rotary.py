"""RoPE for DeepSeek-V3: YaRN scaling, interleaved pairs, and the attention scale YaRN implies.

Only the `qk_rope_head_dim` part of queries and keys is rotated. DeepSeek ships its q/k projection
rows so that the pairs (x0, x1), (x2, x3), … share a frequency (`rope_interleave`, the default); the
rotated result is written de-interleaved ([even outputs; odd outputs]) as transformers does. Queries
and keys are permuted alike, so attention scores are those of DeepSeek's own complex-number RoPE.

YaRN frequencies and factors follow transformers' `_compute_yarn_parameters` (the oracle), in
float32 on the host.
"""

from __future__ import annotations

import math

import torch

from specsplit.models.deepseek_v3.config import DeepseekV3Config
from specsplit.models.rotary import rope_inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: DeepseekV3Config) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim)² when the RoPE is scaled."""
    scale = config.qk_head_dim**-0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def _yarn(config: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """([rope_dim // 2] float32 inverse frequencies, attention factor applied to cos and sin)."""
    scaling = config.rope_scaling
    dim, base, factor = config.qk_rope_head_dim, config.rope_theta, scaling["factor"]
    original_len = scaling["original_max_position_embeddings"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The rotary dimension whose wavelength fits `num_rotations` times into the original context.
        return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high-frequency dims keep their frequency; 0: low ones are interpolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class DeepseekRotary:
    """positions → (cos, sin) [T, rope_dim // 2], already multiplied by YaRN's attention factor.

    Not an nn.Module buffer, so `model.to(torch.bfloat16)` cannot round the frequencies.
    """

    def __init__(self, config: DeepseekV3Config) -> None:
        scaling = config.rope_scaling
        if scaling is not None and scaling["rope_type"] == "yarn":
            self._inv_freq, self.attention_factor = _yarn(config)
        else:
            self._inv_freq, self.attention_factor = rope_inv_freq(config), 1.0

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] int64 → cos, sin: [T, rope_dim // 2] in `dtype`
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    # x: [T, heads, rope_dim], cos/sin: [T, rope_dim // 2] → [T, heads, rope_dim]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
