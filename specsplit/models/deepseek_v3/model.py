"""The DeepSeek-V3 target: embedding, MLA + MoE decoder layers, final norm, LM head.

Same surface as `specsplit.models.target.TargetModel` (`config`, `make_kv_cache`, `forward`, `compute_logits`),
so the verifier serves it unchanged; its cache is a `LatentKVCache`. Parameter names equal the
checkpoint's (`model.embed_tokens.weight`, `model.layers.{i}.…`, `model.norm.weight`, `lm_head.weight`).
"""

from __future__ import annotations

from torch import nn

from specsplit.models.deepseek_v3.latent_cache import LatentKVCache
from specsplit.models.deepseek_v3.layers import DeepseekV3DecoderLayer
from specsplit.models.deepseek_v3.rotary import DeepseekRotary
from specsplit.models.target import TargetModel


class DeepseekV3Target(TargetModel):
    def _make_layer(self, index: int) -> nn.Module:
        return DeepseekV3DecoderLayer(self.config, index)

    def _make_rotary(self):
        return DeepseekRotary(self.config)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> LatentKVCache:
        """A latent cache for every decoder layer, in the weights' dtype and on their device."""
        weight = self.embed_tokens.weight
        return LatentKVCache(
            num_layers=self.config.num_hidden_layers,
            latent_dim=self.config.kv_cache_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
        )
