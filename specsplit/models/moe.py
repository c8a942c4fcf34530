"""DeepSeek-V3's feed-forward blocks, which GLM-4.5 (`Glm4MoeForCausalLM`) shares: the SwiGLU MLP
and the mixture of experts.

MoE(x) = Σ_{e ∈ topk(x)} w_e(x) · expert_e(x) + shared_experts(x), with the router of DeepSeek-V3
(`topk_method: noaux_tc`, `scoring_func: sigmoid`):
    s      = sigmoid(gate(x))                              (float32)
    choice = s + e_score_correction_bias                   (the bias only steers the choice)
    groups: keep the `topk_group` of `n_group` expert groups whose two best `choice` scores sum highest
    topk   = the `num_experts_per_tok` best `choice` among experts of kept groups
    w_e    = s_e / Σ_topk s (if norm_topk_prob) × routed_scaling_factor

Parameter names equal the checkpoint's (`gate.weight`, `gate.e_score_correction_bias`,
`experts.{e}.{gate,up,down}_proj.weight`, `shared_experts.*`). The router stays in float32 whatever
the model dtype (`Router.keep_in_float32`), as transformers keeps it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class MoEConfig(Protocol):
    """The fields of a model configuration the MoE reads (`DeepseekV3Config`, `Glm4MoeConfig`)."""

    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases: the dense MLP, each expert and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    keep_in_float32 = ("weight", "e_score_correction_bias")

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        # A parameter (not a buffer) so the loader fills it like any other checkpoint tensor.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, hidden] → topk_ids [T, top_k] int64, topk_weights [T, top_k] float32
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, num_experts]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(x.shape[0], self.n_group, -1)  # [T, n_group, experts_per_group]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        kept_groups = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).flatten(1)
        topk_ids = choice.topk(self.top_k, dim=-1).indices  # [T, top_k]
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, weights * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config)
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(config.n_routed_experts))
        self.shared_experts = SwiGLU(hidden, inter * config.n_shared_experts) if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        topk_ids, topk_weights = self.gate(x)  # [T, top_k] each
        num_tokens, top_k = topk_ids.shape
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if num_tokens == 0:
            return out
        # The (token, slot) pairs sorted by expert, so each expert reads one contiguous slice of their
        # inputs: one gather, five launches per expert (three GEMMs, silu, mul), one scatter back (no
        # atomics), and one host sync per layer for the per-expert counts.
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)  # [T * top_k] pair index token * top_k + slot, in expert order
        counts = torch.bincount(flat_ids, minlength=len(self.experts)).tolist()
        inputs = x[order // top_k].split(counts)  # [count_e, hidden] per expert
        outputs = torch.cat([expert(part) for expert, part in zip(self.experts, inputs) if part.shape[0]])
        weighted = torch.empty_like(outputs, dtype=torch.promote_types(outputs.dtype, topk_weights.dtype))
        weighted[order] = outputs * topk_weights.flatten()[order, None]  # back in (token, slot) order
        return out + weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
