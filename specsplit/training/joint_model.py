"""Target (transformers' LlamaForCausalLM) and MTP module trained together.

Loss = CE(next token) + mtp_weight * sum_j CE(MTP step j), as in the DeepSeek-V3 report (lambda = 0.3),
extended over `mtp_steps` unrolled steps of the one module (step j predicts x_{p+2+j}) so that draft
positions 2..k are trained the way a drafter uses them. The MTP gradient flows into the trunk. The
MTP output head is the target's LM head (tied to the embedding); the checkpoint stores a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit.training.mtp_head import MTPLayer, MTPUnroll
from specsplit.training.tokenizer import EOS_ID, PAD_ID

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 320
    num_hidden_layers: int = 6
    num_attention_heads: int = 5
    num_key_value_heads: int = 5
    intermediate_size: int = 864
    max_position_embeddings: int = 2048


def demo_config(vocab_size: int, shape: ModelShape) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        num_nextn_predict_layers=1,
    )
    config._attn_implementation = "sdpa"  # mtp_unroll relies on sdpa's boolean masks and is_causal
    return config


class TargetWithMTP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        if config._attn_implementation != "sdpa":
            raise ValueError("TargetWithMTP needs attn_implementation='sdpa'")
        self.config = config
        self.target = LlamaForCausalLM(config)
        self.mtp = MTPLayer(config, layer_idx=config.num_hidden_layers)
        self.mtp.shared_head.head.weight = self.target.get_input_embeddings().weight
        for module in self.mtp.modules():
            if isinstance(module, nn.Linear) and module is not self.mtp.shared_head.head:
                nn.init.normal_(module.weight, std=config.initializer_range)

    def target_forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [batch, seq] -> (hidden after the final norm, logits): [b, s, hidden], [b, s, vocab]."""
        hidden = self.target.model(input_ids=input_ids).last_hidden_state
        return hidden, self.target.lm_head(hidden)

    def mtp_unroll(self, target_hidden: torch.Tensor, first_position: int = 1) -> MTPUnroll:
        """target_hidden: [batch, num_pairs, hidden] -> an unroller whose step j drafts position j + 1."""
        model = self.target.model
        return MTPUnroll(self.mtp, model.embed_tokens, model.rotary_emb, target_hidden, first_position)

    def losses(self, ids: torch.Tensor, mtp_steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """ids: [batch, seq + 1] -> (next-token loss, one MTP loss per step), each a scalar."""
        seq = ids.shape[1] - 1
        hidden, logits = self.target_forward(ids[:, :-1])
        next_loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        # Pair p in 0..seq-2 joins h_p and x_{p+1}; step j reads x_{p+1+j} and predicts x_{p+2+j}.
        num_pairs = seq - 1
        padded = F.pad(ids, (0, mtp_steps), value=PAD_ID)
        labels = F.pad(ids, (0, mtp_steps), value=IGNORE_INDEX)
        step_tokens = [padded[:, 1 + j : 1 + j + num_pairs] for j in range(mtp_steps)]
        step_labels = [labels[:, 2 + j : 2 + j + num_pairs] for j in range(mtp_steps)]
        unroll = self.mtp_unroll(hidden[:, :num_pairs])
        mtp_losses = []
        for tokens, target in zip(step_tokens, step_labels, strict=True):
            mtp_logits = self.mtp.logits(unroll.step(tokens))
            mtp_losses.append(
                F.cross_entropy(mtp_logits.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX)
            )
        return next_loss, mtp_losses


def add_residual_dropout(model: TargetWithMTP, p: float) -> list:
    """Dropout (training mode only) on the embedding output and on every attention and MLP output
    before it joins the residual stream, as GPT-2 does; transformers' Llama has none of its own.
    Implemented as forward hooks, so the modules and the checkpoint stay plain Llama."""

    def drop_output(module, args, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)

    layers = [*model.target.model.layers, model.mtp]
    modules = [model.target.model.embed_tokens] + [m for layer in layers for m in (layer.self_attn, layer.mlp)]
    return [m.register_forward_hook(drop_output) for m in modules] if p > 0 else []
