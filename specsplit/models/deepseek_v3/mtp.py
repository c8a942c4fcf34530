"""DeepSeek-V3's MTP module: checkpoint layer `model.layers.{num_hidden_layers}` (DeepSeek-V3 report §2.2).

    MTP(h_p, x_{p+1}) = block(eh_proj(cat([enorm(embed(x_{p+1})), hnorm(h_p)])))
    logits            = shared_head.head(shared_head.norm(MTP(h_p, x_{p+1})))   → predicts x_{p+2}

`block` is a full DeepSeek-V3 decoder layer: MLA with its own latent cache, and the MoE (the MTP
layer's index is >= first_k_dense_replace). Embedding and LM head are the target's (the checkpoint
may store copies under the MTP layer). Same surface and conventions as `specsplit.models.mtp.MTPModule`
(positions, the pre-norm output fed back for later draft steps), so the drafter serves it unchanged;
checkpoint names come from `specsplit.models.mtp_layout.DEEPSEEK_LAYOUT`.
"""

from __future__ import annotations

from torch import nn

from specsplit.models.deepseek_v3.latent_cache import LatentKVCache
from specsplit.models.deepseek_v3.layers import DeepseekV3DecoderLayer
from specsplit.models.deepseek_v3.rotary import DeepseekRotary
from specsplit.models.mtp import MTPModule
from specsplit.models.mtp_layout import DEEPSEEK_LAYOUT


class DeepseekV3MTP(MTPModule):
    def _make_layout(self):
        return DEEPSEEK_LAYOUT

    def _make_block(self) -> nn.Module:
        return DeepseekV3DecoderLayer(self.config, layer=self.config.num_hidden_layers)

    def _make_rotary(self):
        return DeepseekRotary(self.config)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> LatentKVCache:
        """A one-layer latent cache for the MTP block, in the weights' dtype and on their device."""
        weight = self.embed_tokens.weight  # never FP8 (eh_proj may be)
        return LatentKVCache(
            num_layers=1,
            latent_dim=self.config.kv_cache_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
        )
