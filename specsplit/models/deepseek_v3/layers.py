"""The DeepSeek-V3 decoder layer: x + MLA(norm(x)), then + MLP-or-MoE(norm(.)).

Layers below `first_k_dense_replace` have a dense SwiGLU MLP, the rest (and the MTP layer) the MoE.
Submodule names equal the checkpoint's, so tensors load by name.
"""

from __future__ import annotations

from specsplit.models.deepseek_v3.config import DeepseekV3Config
from specsplit.models.deepseek_v3.mla import MLAttention
from specsplit.models.layers import MLP, PreNormBlock, RMSNorm
from specsplit.models.moe import MoE


class DeepseekV3DecoderLayer(PreNormBlock):
    def __init__(self, config: DeepseekV3Config, layer: int) -> None:
        """`layer` is the checkpoint's layer index (it decides dense MLP or MoE)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer):
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
