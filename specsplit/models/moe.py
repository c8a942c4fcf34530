"""DeepSeek-V3's feed-forward blocks, which GLM-4.5 (`Glm4MoeForCausalLM`) shares: the SwiGLU MLP
and the mixture of experts.

MoE(x) = Σ_{e ∈ topk(x)} w_e(x) · expert_e(x) + shared_experts(x), with the router of DeepSeek-V3
(`topk_method: noaux_tc`, `scoring_func: sigmoid`):
    s      = sigmoid(gate(x))                              (float32)
    choice = s + e_score_correction_bias                   (the bias only steers the choice)
    groups: keep the `topk_group` of `n_group` expert groups whose two best `choice` scores sum highest
    topk   = the `num_experts_per_tok` best `choice` among experts of kept groups
    w_e    = s_e / Σ_topk s (if norm_topk_prob) × routed_scaling_factor

Tensor-parallel (`specsplit.models.parallel`): the experts are split across the ranks (expert parallel:
rank r holds experts [r E/N, (r+1) E/N), with their checkpoint indices), the router is replicated, so
every rank routes every token alike and runs its own experts' pairs; the shared experts and the dense MLP
are column/row-parallel. One all-reduce sums a MoE layer's routed and shared partial outputs.

Parameter names equal the checkpoint's (`gate.weight`, `gate.e_score_correction_bias`,
`experts.{e}.{gate,up,down}_proj.weight`, `shared_experts.*`). The router stays in float32 whatever
the model dtype (`Router.keep_in_float32`), as transformers keeps it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.models.parallel import all_reduce, tp_rank, tp_size
from specsplit.models.parallel_layers import column_parallel_linear, row_parallel_linear


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
    """down(silu(gate(x)) * up(x)), no biases: the dense MLP, each expert and the shared experts.
    `parallel`: gate/up column-parallel and down row-parallel, whose partial output the dense MLP all-reduces
    itself (`reduce`) and the shared experts leave to their MoE; experts are whole on their rank."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, parallel: bool = False, reduce: bool = False):
        super().__init__()
        column, row = (column_parallel_linear, row_parallel_linear) if parallel else (nn.Linear, nn.Linear)
        self.gate_proj = column(hidden_size, intermediate_size, False)
        self.up_proj = column(hidden_size, intermediate_size, False)
        self.down_proj = row(intermediate_size, hidden_size, False)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return all_reduce(out) if self.reduce else out


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
        num_experts = config.n_routed_experts
        if num_experts % tp_size():
            raise ValueError(f"{num_experts} routed experts do not divide into {tp_size()} tensor-parallel ranks")
        per_rank = num_experts // tp_size()
        self.first_expert = tp_rank() * per_rank
        # This rank's experts, keyed by their checkpoint index (`experts.{e}.…`, as the checkpoint names them).
        self.experts = nn.ModuleDict(
            {str(e): SwiGLU(hidden, inter) for e in range(self.first_expert, self.first_expert + per_rank)}
        )
        self.num_experts = num_experts
        self.shared_experts = (
            SwiGLU(hidden, inter * config.n_shared_experts, parallel=True) if config.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        topk_ids, topk_weights = self.gate(x)  # [T, top_k] each
        num_tokens, top_k = topk_ids.shape
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if num_tokens == 0:  # every rank alike: no rows to sum
            return out
        # The (token, slot) pairs sorted by expert, so each expert reads one contiguous slice of their
        # inputs: one gather, five launches per expert (three GEMMs, silu, mul), one scatter back (no
        # atomics), and one host sync per layer for the per-expert counts.
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)  # [T * top_k] pair index token * top_k + slot, in expert order
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        # This rank's experts' pairs: one contiguous run of `order` (all of it on one rank).
        first, last = self.first_expert, self.first_expert + len(self.experts)
        start = sum(counts[:first])
        mine = order[start : start + sum(counts[first:last])]
        if mine.shape[0]:
            inputs = x[mine // top_k].split(counts[first:last])  # [count_e, hidden] per expert of this rank
            outputs = torch.cat([expert(part) for expert, part in zip(self.experts.values(), inputs) if part.shape[0]])
            # Back in (token, slot) order; tensor-parallel, the pairs of other ranks' experts are zeros here.
            shape, dtype = (order.shape[0], outputs.shape[1]), torch.promote_types(outputs.dtype, topk_weights.dtype)
            every_pair = mine.shape[0] == order.shape[0]
            weighted = (torch.empty if every_pair else torch.zeros)(shape, dtype=dtype, device=outputs.device)
            weighted[mine] = outputs * topk_weights.flatten()[mine, None]
            out = out + weighted.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
        return all_reduce(out)  # the routed and shared experts' partial sums of every rank
