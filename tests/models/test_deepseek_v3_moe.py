"""DeepSeek-V3 MoE: grouped top-k sigmoid routing by hand, and the whole block against transformers'."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from specsplit.models.deepseek_v3.config import DeepseekV3Config
from specsplit.models.moe import MoE, Router

ATOL = 1e-5

CONFIG = DeepseekV3Config(
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    rope_interleave=True,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    attention_bias=False,
    num_nextn_predict_layers=1,
)


def _router_with_logits(logits: list[float], bias: list[float] | None = None) -> Router:
    """A router over hidden size 1 whose logits for the input [[1.0]] are `logits`."""
    router = Router(dataclasses.replace(CONFIG, hidden_size=1))
    with torch.no_grad():
        router.weight.copy_(torch.tensor(logits)[:, None])
        router.e_score_correction_bias.copy_(torch.tensor(bias or [0.0] * len(logits)))
    return router


def test_group_limit_beats_the_single_best_expert():
    # Group 0 = experts 0-3 (two good ones), group 1 = experts 4-7 (the best one, then weak ones):
    # group 0's two best scores sum higher, so expert 4 is out although its score is the highest.
    logits = [2.0, 1.0, 0.0, -1.0, 3.0, -2.0, -2.0, -2.0]
    ids, weights = _router_with_logits(logits)(torch.ones(1, 1))
    assert sorted(ids[0].tolist()) == [0, 1]
    s = torch.sigmoid(torch.tensor(logits))
    expected = {0: s[0] / (s[0] + s[1]) * 2.5, 1: s[1] / (s[0] + s[1]) * 2.5}
    for i, w in zip(ids[0].tolist(), weights[0]):
        torch.testing.assert_close(w, expected[i])


def test_correction_bias_steers_the_choice_but_not_the_weights():
    logits = [2.0, 1.0, 0.0, -1.0, 3.0, -2.0, -2.0, -2.0]
    bias = [0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]  # lifts expert 2 above expert 1
    ids, weights = _router_with_logits(logits, bias)(torch.ones(1, 1))
    assert sorted(ids[0].tolist()) == [0, 2]
    s = torch.sigmoid(torch.tensor(logits))  # weights from the raw scores, without the bias
    expected = {0: s[0] / (s[0] + s[2]) * 2.5, 2: s[2] / (s[0] + s[2]) * 2.5}
    for i, w in zip(ids[0].tolist(), weights[0]):
        torch.testing.assert_close(w, expected[i])


def _hf_config(config: DeepseekV3Config) -> transformers.DeepseekV3Config:
    fields = (
        "hidden_size",
        "moe_intermediate_size",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "routed_scaling_factor",
    )
    return transformers.DeepseekV3Config(**{f: getattr(config, f) for f in fields})


def _hf_moe_with_our_weights(moe: MoE, config: DeepseekV3Config) -> DeepseekV3MoE:
    hf = DeepseekV3MoE(_hf_config(config)).float().eval()
    with torch.no_grad():
        hf.gate.weight.copy_(moe.gate.weight)
        hf.gate.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias)
        hf.experts.gate_up_proj.copy_(
            torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in moe.experts.values()])
        )
        hf.experts.down_proj.copy_(torch.stack([e.down_proj.weight for e in moe.experts.values()]))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(hf.shared_experts, name).weight.copy_(getattr(moe.shared_experts, name).weight)
    return hf


@pytest.mark.parametrize(
    "groups",
    [
        {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 2},
        {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "n_routed_experts": 16, "n_shared_experts": 2},
        {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 4, "norm_topk_prob": False},
        {"n_group": 2, "topk_group": 2, "num_experts_per_tok": 3},  # every group kept: the group stage skipped
    ],
    ids=["2-groups", "4-groups", "ungrouped-unnormalised", "every-group-kept"],
)
def test_moe_matches_transformers(groups):
    config = dataclasses.replace(CONFIG, **groups)
    g = torch.Generator().manual_seed(0)
    moe = MoE(config)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_((0.1 if name.endswith("bias") else 0.3) * torch.randn(p.shape, generator=g))
    hf = _hf_moe_with_our_weights(moe, config)
    x = torch.randn(64, config.hidden_size, generator=g)
    with torch.no_grad():
        ids, weights = moe.gate(x)
        _, hf_weights, hf_ids = hf.gate(x)
        ours, theirs = moe(x), hf(x[None])[0]
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)  # the same experts for every token
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # Tokens spread over experts (the test is not passing on one expert), each exactly top-k of them.
    assert len(ids.unique()) == config.n_routed_experts
    assert all(len(set(row)) == config.num_experts_per_tok for row in ids.tolist())
