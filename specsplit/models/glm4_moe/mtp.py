"""GLM-4.5's MTP module: checkpoint layer `model.layers.{num_hidden_layers}`, in DeepSeek-V3's layout.

    MTP(h_p, x_{p+1}) = block(eh_proj(cat([enorm(embed(x_{p+1})), hnorm(h_p)])))
    logits            = shared_head.head(shared_head.norm(MTP(h_p, x_{p+1})))   → predicts x_{p+2}

`block` is a full GLM-4.5 decoder layer (GQA attention with its own paged cache, the MoE: the MTP
layer's index is past first_k_dense_replace). Embedding and LM head are the target's; the checkpoint may
store copies under the MTP layer (`embed_tokens`, `shared_head.head`), and `DEEPSEEK_LAYOUT` takes them
when present. transformers' Glm4MoeForCausalLM skips these tensors on load.
"""

from __future__ import annotations

from torch import nn

from specsplit.models.glm4_moe.layers import Glm4MoeDecoderLayer
from specsplit.models.mtp import MTPModule
from specsplit.models.mtp_layout import DEEPSEEK_LAYOUT


class Glm4MoeMTP(MTPModule):
    def _make_layout(self):
        return DEEPSEEK_LAYOUT

    def _make_block(self) -> nn.Module:
        return Glm4MoeDecoderLayer(self.config, layer=self.config.num_hidden_layers)
