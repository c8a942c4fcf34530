"""Building blocks of a Llama-style decoder: RMSNorm, SwiGLU MLP, self-attention, decoder layer.

Submodule names equal Hugging Face's (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...)
so checkpoint tensors load by name. The same `DecoderLayer` serves the target and the MTP block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import paged_attention
from models.config import ModelConfig
from models.kv_cache import AttentionMetadata, PagedKVCache
from models.rotary import RotaryEmbedding, apply_rotary

__all__ = ["MLP", "DecoderLayer", "RMSNorm", "RotaryEmbedding", "SelfAttention", "check_token_inputs"]


def check_token_inputs(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and positions must both be [num_tokens], got {tuple(input_ids.shape)} "
            f"and {tuple(positions.shape)}"
        )


class RMSNorm(nn.Module):
    """Computed in float32 and cast back before the weight, as transformers does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size] → [..., size]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """GQA self-attention with optional qkv bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, qkv_bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, head_dim]
        kv_cache: PagedKVCache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache.k[cache_layer], kv_cache.v[cache_layer], attn)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). Returns the full residual stream."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, head_dim]
        kv_cache: PagedKVCache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, cache_layer, attn)
        return x + self.mlp(self.post_attention_layernorm(x))
