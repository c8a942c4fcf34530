"""DeepSeek-V3's router (GLM-4.5's too) after its gate GEMV, in one launch: sigmoid scores, the bias-steered choice,
the expert-group stage, the top-k and the normalised, scaled weights (`specsplit.models.moe` states the rule).

One program per token holds its E router logits in registers, as [groups, experts per group] (each padded to a power
of two, the padding at -inf). A group's score is the sum of its two best choices; the `topk_group` best groups are
kept; then the `top_k` best choices of the kept groups are taken one after another (the highest first, ties to the
lowest id, as `torch.topk` orders them). The torch ops it replaces (`route_reference`) are about ten launches per
MoE layer, most of a batch-1 decode step's routing time on a GPU (docs/performance.md, "Cuts one H100 holds").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def route_reference(
    logits: torch.Tensor,  # [T, E] float32, the gate GEMV's output
    bias: torch.Tensor,  # [E] float32, e_score_correction_bias
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_ids [T, top_k] int64, weights [T, top_k] float32
    scores = logits.sigmoid()
    choice = scores + bias
    if topk_group < n_group:  # else every group is kept (GLM-4.5's one group): nothing to mask
        grouped = choice.view(logits.shape[0], n_group, -1)  # [T, n_group, experts_per_group]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        kept_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
        choice = grouped.masked_fill(~group_mask[:, :, None], float("-inf")).flatten(1)
    topk_ids = choice.topk(top_k, dim=-1).indices  # [T, top_k]
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_ids, weights * routed_scaling_factor


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    stride_logits,
    scale,
    GROUPS: tl.constexpr,
    PER_GROUP: tl.constexpr,
    GROUPS_P2: tl.constexpr,
    PER_GROUP_P2: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_P2: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_P2)[:, None]
    c = tl.arange(0, PER_GROUP_P2)[None, :]
    real = (g < GROUPS) & (c < PER_GROUP)
    expert = g * PER_GROUP + c  # [GROUPS_P2, PER_GROUP_P2]
    logits = tl.load(logits_ptr + t * stride_logits + expert, mask=real, other=0.0)
    scores = tl.where(real, tl.sigmoid(logits), 0.0)
    choice = tl.where(real, scores + tl.load(bias_ptr + expert, mask=real, other=0.0), float("-inf"))
    if KEEP_GROUPS < GROUPS:
        best = tl.max(choice, axis=1)  # [GROUPS_P2]
        first = tl.argmax(choice, axis=1, tie_break_left=True)
        second = tl.max(tl.where(c == first[:, None], float("-inf"), choice), axis=1)
        group = tl.arange(0, GROUPS_P2)
        group_score = tl.where(group < GROUPS, best + second, float("-inf"))
        kept = group < 0
        for _ in tl.static_range(KEEP_GROUPS):
            pick = tl.argmax(group_score, axis=0, tie_break_left=True)
            kept = kept | (group == pick)
            group_score = tl.where(group == pick, float("-inf"), group_score)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    flat_choice = tl.reshape(choice, (GROUPS_P2 * PER_GROUP_P2,))
    flat_scores = tl.reshape(scores, (GROUPS_P2 * PER_GROUP_P2,))
    flat_expert = tl.reshape(expert, (GROUPS_P2 * PER_GROUP_P2,))
    slot = tl.arange(0, GROUPS_P2 * PER_GROUP_P2)
    k = tl.arange(0, TOP_K_P2)
    ids = tl.zeros((TOP_K_P2,), dtype=tl.int64)
    weights = tl.zeros((TOP_K_P2,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # ties to the lowest expert id: slots are ordered by expert id, the padding after the real ones of a group
        at = tl.argmax(flat_choice, axis=0, tie_break_left=True)
        hit = slot == at
        ids = tl.where(k == j, tl.sum(tl.where(hit, flat_expert, 0)).to(tl.int64), ids)
        weights = tl.where(k == j, tl.sum(tl.where(hit, flat_scores, 0.0)), weights)
        flat_choice = tl.where(hit, float("-inf"), flat_choice)
    if NORM:
        weights = weights / (tl.sum(weights) + 1e-20)
    out = k < TOP_K
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=out)
    tl.store(weights_ptr + t * TOP_K + k, weights * scale, mask=out)


def route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference` in one launch (its arguments and results). Needs float32 logits whose rows are contiguous,
    n_group dividing E and, with a group stage, at least two experts per group."""
    num_tokens, num_experts = logits.shape
    if num_experts % n_group or (topk_group < n_group and num_experts // n_group < 2):
        raise ValueError(f"{num_experts} experts in {n_group} groups: not a router this kernel takes")
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("route_triton takes float32 logits with contiguous rows")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    if num_tokens == 0:
        return ids, weights
    per_group = num_experts // n_group
    _route_kernel[(num_tokens,)](
        logits,
        bias.float().contiguous(),
        ids,
        weights,
        logits.stride(0),
        float(routed_scaling_factor),
        GROUPS=n_group,
        PER_GROUP=per_group,
        GROUPS_P2=triton.next_power_of_2(n_group),
        PER_GROUP_P2=triton.next_power_of_2(per_group),
        KEEP_GROUPS=topk_group,
        TOP_K=top_k,
        TOP_K_P2=triton.next_power_of_2(top_k),
        NORM=bool(norm_topk_prob),
    )
    return ids, weights
