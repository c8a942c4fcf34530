"""The DeepSeek-V3 decoder layer: x + MLA(norm(x)), then + MLP-or-MoE(norm(.)).

Layers below `first_k_dense_replace` have a dense SwiGLU MLP, the rest (and the MTP layer) the MoE.
Submodule names equal the checkpoint's, so tensors load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.latent_cache import LatentKVCache
from models.deepseek_v3.mla import MLAttention
from models.deepseek_v3.moe import MoE, SwiGLU
from models.kv_cache import AttentionMetadata
from models.layers import RMSNorm


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer: int) -> None:
        """`layer` is the checkpoint's layer index (it decides dense MLP or MoE)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config) if config.is_moe_layer(layer) else SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, qk_rope_head_dim // 2]
        kv_cache: LatentKVCache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        mlp_out, residual = self.forward_deferred(x, None, rope, kv_cache, cache_layer, attn)
        return residual + mlp_out

    def forward_deferred(
        self,
        x: torch.Tensor,  # [T, hidden]: the layer's input, or (with residual) the last layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden]: the stream x still has to be added to
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: LatentKVCache,
        cache_layer: int,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # MLP output, and the stream it still has to be added to
        """As `models.layers.DecoderLayer.forward_deferred`: the last add fuses into the next norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        attn_out = self.self_attn(h, rope, kv_cache, cache_layer, attn)
        h, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(h), residual
