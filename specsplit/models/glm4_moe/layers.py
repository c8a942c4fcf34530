"""The GLM-4.5 decoder layer: x + attn(norm(x)), then + MLP-or-MoE(norm(.)).

The attention is the Llama family's GQA `SelfAttention` (q/k/v bias, optional q/k norm, partial
rotary: all in its config); layers below `first_k_dense_replace` have the dense SwiGLU `MLP`, the rest
(and the MTP layer) DeepSeek-V3's MoE. Submodule names equal the checkpoint's, so tensors load by name.
"""

from __future__ import annotations

from specsplit.models.glm4_moe.config import Glm4MoeConfig
from specsplit.models.layers import MLP, PreNormBlock, RMSNorm, SelfAttention
from specsplit.models.moe import MoE


class Glm4MoeDecoderLayer(PreNormBlock):
    def __init__(self, config: Glm4MoeConfig, layer: int) -> None:
        """`layer` is the checkpoint's layer index (it decides dense MLP or MoE)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
