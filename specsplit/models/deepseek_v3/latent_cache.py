"""Paged cache of MLA latents: one vector of `kv_lora_rank + qk_rope_head_dim` per token and layer.

Multi-head latent attention caches what it projects keys and values from, not the keys and values:
the normalised latent c_kv (`kv_lora_rank`) and the shared, already rotated RoPE key k_pe
(`qk_rope_head_dim`), concatenated. For DeepSeek-V3 that is 576 values per token and layer instead of
128 heads × (192 + 128) = 40,960 for expanded K and V.

Block tables, rollback and step metadata are `PagedBlocks`', exactly as for the Llama-family cache.
"""

from __future__ import annotations

import torch

from specsplit.models.kv_cache import PagedBlocks


class LatentKVCache(PagedBlocks):
    def __init__(
        self,
        num_layers: int,
        latent_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_layers < 1 or latent_dim < 1:
            raise ValueError(f"num_layers and latent_dim must be >= 1, got {num_layers}, {latent_dim}")
        super().__init__(num_blocks, block_size)
        # latent: [num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
        self.latent = torch.zeros((num_layers, num_blocks, block_size, latent_dim), dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies, over all layers."""
        return self.latent.nbytes // (self.num_blocks * self.block_size)
