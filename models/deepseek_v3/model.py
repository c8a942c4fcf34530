"""The DeepSeek-V3 target: embedding, MLA + MoE decoder layers, final norm, LM head.

Same surface as `models.target.TargetModel` (`config`, `make_kv_cache`, `forward`, `compute_logits`),
so the verifier serves it unchanged; its cache is a `LatentKVCache`. Parameter names equal the
checkpoint's (`model.embed_tokens.weight`, `model.layers.{i}.…`, `model.norm.weight`, `lm_head.weight`).
"""

from __future__ import annotations

import torch
from torch import nn

from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.latent_cache import LatentKVCache
from models.deepseek_v3.layers import DeepseekV3DecoderLayer
from models.deepseek_v3.rotary import DeepseekRotary
from models.kv_cache import AttentionMetadata
from models.layers import RMSNorm, check_token_inputs


class _DecoderStack(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3Target(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.model = _DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = DeepseekRotary(config)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def norm(self) -> RMSNorm:
        return self.model.norm

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

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: LatentKVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm (what the MTP head consumes)
        check_token_inputs(input_ids, positions)
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache, i, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] → [N, vocab] float32
        return self.lm_head(hidden).float()
