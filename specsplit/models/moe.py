"""DeepSeek-V3's mixture of experts, which GLM-4.5 (`Glm4MoeForCausalLM`) shares; its shared experts and each
routed expert are SwiGLU `MLP`s (`specsplit.models.layers`), as the dense layers' MLP.

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
`experts.{e}.{gate,up,down}_proj.weight`, `shared_experts.*`) until the loader stacks the routed experts
(`StackedExperts`: `experts.gate_up_proj`, `experts.down_proj`), which the fused MoE
(`specsplit.kernels.fused_moe`) runs on CUDA with no host sync, so MoE models can be captured in CUDA graphs.
The router stays in float32 whatever the model dtype (`Router.keep_in_float32`), as transformers keeps it.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.kernels.fused_moe import fused_routed_experts, routed_experts_reference
from specsplit.kernels.router import route_reference, route_triton
from specsplit.models.fp8_linear import Fp8Linear
from specsplit.models.layers import MLP
from specsplit.models.parallel import all_reduce, tp_rank, tp_size

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
        # x: [T, hidden] → topk_ids [T, top_k] int64, topk_weights [T, top_k] float32; on CUDA the routing after the
        # gate GEMV is one kernel (`specsplit.kernels.router`), elsewhere its torch ops
        logits = F.linear(x.float(), self.weight.float())  # [T, num_experts]
        route = route_triton if x.is_cuda and not _INTERPRETED else route_reference
        return route(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )


class StackedExperts(nn.Module):
    """This rank's routed experts stacked, for the fused MoE (`specsplit.kernels.fused_moe`): `gate_up_proj`
    [E_local, 2 * inter, hidden] (each expert's gate rows, then its up rows) and `down_proj` [E_local, hidden,
    inter] (transformers' names and layout), in the model dtype, or e4m3 with their block scales
    (`gate_up_proj_scale_inv`, `down_proj_scale_inv`) where the experts were `Fp8Linear`s (kept FP8: on CUDA).
    Built from the loaded experts, each an `MLP` whose gate and up are fused (`MoE.fuse_projections`)."""

    def __init__(self, experts: list[MLP], first_expert: int) -> None:
        super().__init__()
        self.first_expert = first_expert
        first = experts[0]
        self.fp8_blocks: tuple[int, int, int] | None = None  # scale rows of gate_up and down, group along K
        self.gate_up_proj = _stacked([e.gate_up_proj.weight for e in experts])
        self.down_proj = _stacked([e.down_proj.weight for e in experts])
        if isinstance(first.gate_up_proj, Fp8Linear):  # per-row scales where gate's rows cut a scale block
            self.gate_up_proj_scale_inv = _stacked([e.gate_up_proj.weight_scale_inv for e in experts])
            self.down_proj_scale_inv = _stacked([e.down_proj.weight_scale_inv for e in experts])
            self.fp8_blocks = (first.gate_up_proj.scale_block_n, first.down_proj.scale_block_n, first.down_proj.block_k)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden], topk_ids / topk_weights: [T, top_k] → [T, hidden]: the routed experts' weighted sum
        # (other ranks' experts contribute zeros). On CUDA the fused kernels (no host sync: capturable), else the
        # per-expert loop in torch (the CPU path's numerics, with the host's per-expert counts).
        scales = None
        if self.fp8_blocks is not None:
            scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv, *self.fp8_blocks)
        run = fused_routed_experts if x.is_cuda and not _INTERPRETED else routed_experts_reference
        return run(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj, self.first_expert, scales)


def _stacked(tensors: list[torch.Tensor]) -> nn.Parameter:
    return nn.Parameter(torch.stack(tensors), requires_grad=False)


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
        # This rank's experts, keyed by their checkpoint index (`experts.{e}.…`, as the checkpoint names them),
        # until `fuse_projections` stacks them into one `StackedExperts`.
        local = range(self.first_expert, self.first_expert + per_rank)
        self.experts: nn.ModuleDict | StackedExperts = nn.ModuleDict(
            {str(e): MLP(hidden, inter, sharded=False, reduce=False) for e in local}
        )
        self.num_experts = num_experts
        self.shared_experts = (
            MLP(hidden, inter * config.n_shared_experts, reduce=False) if config.n_shared_experts else None
        )

    def fuse_projections(self) -> None:
        """The loaded experts, their gate and up fused, → one `StackedExperts` (`experts.gate_up_proj`,
        `experts.down_proj`, ...); the per-expert tensors are freed once stacked (the peak is one layer's experts
        twice)."""
        if isinstance(self.experts, nn.ModuleDict):
            experts = list(self.experts.values())
            for expert in experts:  # done already where the loader fused the model (children first)
                expert.fuse_projections()
            self.experts = StackedExperts(experts, self.first_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] → [T, hidden]
        self.fuse_projections()  # done by the loader (`specsplit.models.layers.fuse_projections`); modules built
        # by hand (tests) stack their experts on their first call
        topk_ids, topk_weights = self.gate(x)  # [T, top_k] each
        out = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        if x.shape[0] == 0:  # every rank alike: no rows to sum
            return out
        out = out + self.experts(x, topk_ids, topk_weights)
        return all_reduce(out)  # the routed and shared experts' partial sums of every rank
