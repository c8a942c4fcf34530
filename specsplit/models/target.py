"""The target model: a dense Llama-style decoder (Llama, Qwen2, Qwen3, MiMo's main model).

Parameter names equal Hugging Face's (`model.embed_tokens.weight`, `model.layers.{i}.…`,
`model.norm.weight`, `lm_head.weight`), so a checkpoint's tensors load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from specsplit.models.config import ModelConfig
from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.layer_ops import linear
from specsplit.models.layers import DecoderLayer, RMSNorm, check_token_inputs, local_heads
from specsplit.models.parallel_layers import VocabParallelEmbedding, gather_logits, lm_head
from specsplit.models.rotary import RotaryEmbedding


class _DecoderStack(nn.Module):
    def __init__(self, config, make_layer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TargetModel(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Other families (models/deepseek_v3) subclass
    it and override `_make_layer`, `_make_rotary` and `make_kv_cache`. Built in a tensor-parallel process
    (`specsplit.models.parallel`), it holds this rank's shard: vocab-parallel embedding and head, the
    layers' heads and MLP columns split, the cache this rank's KV heads."""

    # Attention can run the Triton paged kernel (`AttentionMetadata.use_kernel`), hence CUDA graphs.
    supports_attention_kernel = True
    supports_cuda_graphs = True  # no host sync in the forward (the MoE's too: kernels/fused_moe.py)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _DecoderStack(config, self._make_layer)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = self._make_rotary()

    def _make_layer(self, index: int) -> nn.Module:
        return DecoderLayer(self.config)

    def _make_rotary(self):
        return RotaryEmbedding(self.config)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def norm(self) -> RMSNorm:
        return self.model.norm

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A cache for every decoder layer, in the weights' dtype and on their device."""
        weight = self.embed_tokens.weight
        return PagedKVCache(
            num_layers=self.config.num_hidden_layers,
            num_kv_heads=local_heads(self.config.num_attention_heads, self.config.num_key_value_heads)[1],
            head_dim=self.config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: PagedKVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm (what the MTP head consumes)
        check_token_inputs(input_ids, positions)
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None  # each layer's last add is fused into the next norm
        for i, layer in enumerate(self.layers):
            x, residual = layer.forward_deferred(x, residual, rope, kv_cache, i, attn)
        return self.norm.add_and_norm(x, residual)[0] if residual is not None else self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, hidden] → [N, vocab] float32 (tensor-parallel: on the first rank; None on the others)
        return gather_logits(linear(hidden, self.lm_head).float(), self.config.vocab_size)
