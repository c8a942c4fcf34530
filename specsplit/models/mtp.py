"""The MTP (multi-token prediction) module: layer 0 of the checkpoint's MTP layers.

    MTP(h_p, x_{p+1}) = block(eh_proj(cat([enorm(embed(x_{p+1})), hnorm(h_p)])))
    logits            = shared_head.head(shared_head.norm(MTP(h_p, x_{p+1})))   → predicts x_{p+2}

(MiMo: concat order [hnorm(h), enorm(e)] and the norm moved into forward; see `specsplit.models.mtp_layout`.)

Position convention: the module applies whatever RoPE positions its caller passes. specsplit's
drafter runs the pair (h_p, x_{p+1}) at position p + 1, the position of x_{p+1} (the demo checkpoint
was trained that way), and draft step s >= 1 one position further each time. vLLM
(`v1/spec_decode/eagle.py`) uses p, the position of h_p; RoPE only sees position differences, so the
two give the same outputs up to rounding as long as one is used consistently (tested).

Tensor-parallel (`specsplit.models.parallel`, a drafter's `--tensor-parallel-size`): the embedding and the
head are vocab-parallel (logits gathered to the first rank, which picks the drafts) and the block is sharded
as the target's layers are (heads, MLP, experts); `eh_proj` and the norms are replicated.

Unlike vLLM we do not zero the embedding at position 0: after the shift that row holds the real
token x_1 (vllm-project/vllm#33299, "MTP does not mask embedding on position 0").
"""

from __future__ import annotations

import torch
from torch import nn

from specsplit.models.config import ModelConfig
from specsplit.models.kv_cache import AttentionMetadata, PagedKVCache
from specsplit.models.layer_ops import linear
from specsplit.models.layers import DecoderLayer, RMSNorm, check_token_inputs, local_heads
from specsplit.models.mtp_layout import mtp_layout
from specsplit.models.parallel_layers import VocabParallelEmbedding, gather_logits, lm_head
from specsplit.models.rotary import RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = lm_head(config.hidden_size, config.vocab_size)


class MTPModule(nn.Module):
    # Attention can run the Triton paged kernel (`AttentionMetadata.use_kernel`).
    supports_attention_kernel = True
    supports_cuda_graphs = True  # no host sync in the forward (the MoE's too: kernels/fused_moe.py)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layout = self._make_layout()
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = self._make_block()
        self.shared_head = SharedHead(config)
        self.rotary = self._make_rotary()
        # A draft vocabulary's head (`specsplit/drafter/draft_vocab.py`): N rows of shared_head.head, which the
        # logits then score instead of every id (column c: the draft vocabulary's id c). None: the full vocabulary.
        self.draft_head: nn.Linear | None = None

    # Other families (models/deepseek_v3) override these three and `make_kv_cache`.
    def _make_layout(self):
        return mtp_layout(self.config)

    def _make_block(self) -> nn.Module:
        return DecoderLayer(self.config)

    def _make_rotary(self):
        return RotaryEmbedding(self.config)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A one-layer cache for the MTP block, in the weights' dtype and on their device."""
        weight = self.embed_tokens.weight  # never FP8 (eh_proj may be)
        return PagedKVCache(
            num_layers=1,
            num_kv_heads=local_heads(self.config.num_attention_heads, self.config.num_key_value_heads)[1],
            head_dim=self.config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=weight.dtype,
            device=weight.device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, x_{p+1}
        previous_hidden: torch.Tensor,  # [T, hidden], h_p: target post-norm hidden, or this module's output
        positions: torch.Tensor,  # [T] int64 RoPE positions of the pairs (see the module docstring)
        kv_cache: PagedKVCache,
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        """Returns the state that `compute_logits` turns into logits and that later draft steps feed
        back as `previous_hidden`: the block output before shared_head.norm (DeepSeek layout), after
        it for MiMo (its final_layernorm is part of the layer, as in vLLM)."""
        check_token_inputs(input_ids, positions)
        if previous_hidden.shape != (input_ids.shape[0], self.config.hidden_size):
            raise ValueError(
                f"previous_hidden has shape {tuple(previous_hidden.shape)}, expected "
                f"({input_ids.shape[0]}, {self.config.hidden_size})"
            )
        e = self.enorm(self.embed_tokens(input_ids))
        h = self.hnorm(previous_hidden.to(e.dtype))
        x = linear(torch.cat([h, e] if self.layout.hidden_first else [e, h], dim=-1), self.eh_proj)
        out = self.block(x, self.rotary(positions, x.dtype), kv_cache, 0, attn)
        return self.shared_head.norm(out) if self.layout.normed_output else out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [N, hidden] (output of forward) → [N, vocab] float32 (tensor-parallel: on the first rank; None
        # on the others); with a draft head [N, its rows]
        if not self.layout.normed_output:
            hidden = self.shared_head.norm(hidden)
        if self.draft_head is not None:
            return linear(hidden, self.draft_head).float()
        return gather_logits(linear(hidden, self.shared_head.head).float(), self.config.vocab_size)
