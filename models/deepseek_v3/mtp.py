"""DeepSeek-V3's MTP module: checkpoint layer `model.layers.{num_hidden_layers}` (DeepSeek-V3 report §2.2).

    MTP(h_p, x_{p+1}) = block(eh_proj(cat([enorm(embed(x_{p+1})), hnorm(h_p)])))
    logits            = shared_head.head(shared_head.norm(MTP(h_p, x_{p+1})))   → predicts x_{p+2}

`block` is a full DeepSeek-V3 decoder layer: MLA with its own latent cache, and the MoE (the MTP
layer's index is >= first_k_dense_replace). Embedding and LM head are the target's (the checkpoint
may store copies under the MTP layer). Same surface and conventions as `models.mtp.MTPModule`
(positions, the pre-norm output fed back for later draft steps), so the drafter serves it unchanged;
checkpoint names come from `models.mtp_layout.DEEPSEEK_LAYOUT`.
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
from models.mtp import SharedHead
from models.mtp_layout import DEEPSEEK_LAYOUT


class DeepseekV3MTP(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.config = config
        self.layout = DEEPSEEK_LAYOUT
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer=config.num_hidden_layers)
        self.shared_head = SharedHead(config)
        self.rotary = DeepseekRotary(config)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> LatentKVCache:
        """A one-layer latent cache for the MTP block, in the weights' dtype and on their device."""
        weight = self.eh_proj.weight
        return LatentKVCache(
            num_layers=1,
            latent_dim=self.config.kv_cache_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, x_{p+1}
        previous_hidden: torch.Tensor,  # [T, hidden], h_p: target post-norm hidden, or this module's output
        positions: torch.Tensor,  # [T] int64 (see models.mtp for the convention)
        kv_cache: LatentKVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], the block output before shared_head.norm
        check_token_inputs(input_ids, positions)
        if previous_hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(
                f"previous_hidden has shape {tuple(previous_hidden.shape)}, expected "
                f"({input_ids.shape[0]}, {self.config.hidden_size})"
            )
        e = self.enorm(self.embed_tokens(input_ids))
        h = self.hnorm(previous_hidden.to(e.dtype))
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        return self.block(x, self.rotary(positions, x.dtype), kv_cache, 0, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] (output of forward) → [N, vocab] float32
        return self.shared_head.head(self.shared_head.norm(hidden)).float()
