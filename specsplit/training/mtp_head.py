"""The MTP module in DeepSeek-V3 layout, built on transformers' own Llama decoder layer.

For the pair (h_p, x_{p+1}) — the target's hidden state at p after its final norm and the token
that follows p — one MTP step computes

    m_p = DecoderLayer(eh_proj([enorm(embed(x_{p+1})); hnorm(h_p)]))   at rotary position p + 1
    logits_p = shared_head.head(shared_head.norm(m_p))                  which predict x_{p+2}

with causal attention over the pairs. Parameter names (inside `model.layers.{num_hidden_layers}.`)
are the checkpoint's: enorm, hnorm, eh_proj, shared_head.{norm,head} and the decoder layer's own
input_layernorm, self_attn.*, post_attention_layernorm, mlp.*.

Drafting k tokens reuses the module: step j > 0 takes the pair (m_p of step j - 1, the draft of step
j - 1) at position p + 1 + j. Its query sees the step-0 keys of all pairs up to p (the drafter's MTP
KV cache holds step 0's entries) and the keys of steps 1..j at p itself. `unrolled_mask` writes that
pattern down so that training and measurement see exactly what a drafter with a KV cache sees.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm


class SharedHead(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class MTPLayer(LlamaDecoderLayer):
    """A Llama decoder layer plus the DeepSeek-V3 MTP projections; `forward` is the plain layer."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        hidden = config.hidden_size
        self.enorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(config)

    def combine(self, token_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """token_embeds, hidden: [batch, num_pairs, hidden] -> layer input [batch, num_pairs, hidden]."""
        return self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))

    def logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        """mtp_hidden: [batch, num_pairs, hidden] -> [batch, num_pairs, vocab]."""
        return self.shared_head.head(self.shared_head.norm(mtp_hidden))


def unrolled_mask(num_pairs: int, num_steps: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean attention mask (True = may attend) over `num_steps` stacked blocks of `num_pairs` rows.

    Row (step a, pair i) sees column (step 0, pair i') for i' <= i and column (step b, pair i) for
    0 < b <= a. Returns [1, 1, num_steps * num_pairs, num_steps * num_pairs].
    """
    pair = torch.arange(num_pairs, device=device)
    step = torch.arange(num_steps, device=device)
    row_pair, col_pair = pair.view(1, -1, 1, 1), pair.view(1, 1, 1, -1)
    row_step, col_step = step.view(-1, 1, 1, 1), step.view(1, 1, -1, 1)
    causal_on_step0 = (col_step == 0) & (col_pair <= row_pair)
    same_pair_later_step = (col_step > 0) & (col_step <= row_step) & (col_pair == row_pair)
    mask = causal_on_step0 | same_pair_later_step  # [steps, pairs, steps, pairs]
    size = num_steps * num_pairs
    return mask.reshape(1, 1, size, size)


class MTPUnroll:
    """MTP steps over all pairs of a sequence, one `step` call per draft position.

    Pair p of step j reads x_{p+1+j}, sits at rotary position first_position + p + j and predicts
    x_{p+2+j}. Step j recomputes the rows of steps < j (their outputs are unchanged by construction)
    so that it can attend to their keys under `unrolled_mask`.
    """

    def __init__(
        self,
        mtp: MTPLayer,
        embed: nn.Embedding,
        rotary: nn.Module,
        target_hidden: torch.Tensor,  # [batch, num_pairs, hidden], after the target's final norm
        first_position: int = 1,
    ):
        self.mtp, self.embed, self.rotary = mtp, embed, rotary
        self.num_pairs = target_hidden.shape[1]
        self.pair_positions = torch.arange(self.num_pairs, device=target_hidden.device) + first_position
        self.previous = target_hidden
        self.inputs: list[torch.Tensor] = []

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [batch, num_pairs], x_{p+1+j} for the next step j -> MTP hidden [batch, num_pairs, hidden]."""
        j = len(self.inputs)
        self.inputs.append(self.mtp.combine(self.embed(tokens), self.previous))
        stacked = torch.cat(self.inputs, dim=1)  # [batch, (j + 1) * num_pairs, hidden]
        position_ids = torch.cat([self.pair_positions + s for s in range(j + 1)]).unsqueeze(0)
        mask = None if j == 0 else unrolled_mask(self.num_pairs, j + 1, stacked.device)
        out = self.mtp(
            stacked,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=self.rotary(stacked, position_ids),
        )
        self.previous = out[:, j * self.num_pairs :]
        return self.previous
