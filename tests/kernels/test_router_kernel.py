"""The router kernel (`specsplit.kernels.router`) picks the experts the torch ops pick, in their order, with their
weights: one group (GLM-4.5), the expert-group stage (DeepSeek-V3), groups and expert counts that are not powers of
two, with and without the normalisation."""

from __future__ import annotations

import pytest
import torch

from specsplit.kernels.router import route_reference, route_triton

CONFIGS = {
    "glm-4.5": dict(experts=128, top_k=8, n_group=1, topk_group=1, norm=True, scale=1.0),
    "deepseek-v3": dict(experts=256, top_k=8, n_group=8, topk_group=4, norm=True, scale=2.5),
    "twelve-experts": dict(experts=12, top_k=2, n_group=1, topk_group=1, norm=True, scale=1.0),
    "odd-groups": dict(experts=18, top_k=3, n_group=3, topk_group=2, norm=False, scale=1.5),
    "every-group-kept": dict(experts=16, top_k=3, n_group=4, topk_group=4, norm=True, scale=1.0),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_the_kernel_routes_as_the_torch_ops(name, num_tokens):
    c = CONFIGS[name]
    g = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, c["experts"], generator=g) * 2
    bias = torch.randn(c["experts"], generator=g) * 0.1
    args = (c["top_k"], c["n_group"], c["topk_group"], c["norm"], c["scale"])
    ids, weights = route_triton(logits, bias, *args)
    want_ids, want_weights = route_reference(logits, bias, *args)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


def test_the_group_stage_keeps_experts_out_of_dropped_groups():
    """Two groups of four, one kept: the best single expert sits in the group whose two best sum lower, so it is not
    picked."""
    logits = torch.tensor([[9.0, -9.0, -9.0, -9.0, 1.7, 2.0, 1.8, 1.9]])
    ids, _ = route_triton(logits, torch.zeros(8), 2, 2, 1, True, 1.0)
    assert ids[0].tolist() == [5, 7]
    assert torch.equal(ids, route_reference(logits, torch.zeros(8), 2, 2, 1, True, 1.0)[0])


def test_a_router_the_kernel_cannot_take_is_refused():
    with pytest.raises(ValueError, match="groups"):
        route_triton(torch.zeros(1, 10), torch.zeros(10), 2, 3, 2, True, 1.0)
