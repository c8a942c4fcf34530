"""Our DeepSeek-V3 target gives transformers' logits on the same tiny checkpoint, incrementally too."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers

from specsplit.models.deepseek_v3.config import DeepseekV3Config
from specsplit.models.deepseek_v3.mla import attend_absorbed, attend_expanded
from specsplit.models.deepseek_v3.model import DeepseekV3Target
from specsplit.models.loader import load_config, load_target
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint

ATOL = 1e-4

VARIANTS = {
    # DeepSeek-V3 as shipped: q LoRA, interleaved RoPE, YaRN with mscale = mscale_all_dim.
    "v3": {},
    # V2-Lite style plain q_proj, rotate-half RoPE, no scaling, tied head.
    "q_proj-neox-tied": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "rope_scaling": None,
        "tie_word_embeddings": True,
    },
    # YaRN whose cos/sin carry an attention factor != 1 (mscale != mscale_all_dim), more groups.
    "yarn-mscale": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
        "n_routed_experts": 12,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 3,
    },
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def make(variant: str = "v3"):
        if variant not in cache:
            cache[variant] = write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp(variant), **VARIANTS[variant])
        return cache[variant]

    return make


def _hf(path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


def _forward_logits(model, sequences: dict[str, torch.Tensor], cache=None) -> torch.Tensor:
    cache = cache or model.make_kv_cache(num_blocks=96, block_size=4)
    attn = cache.prepare_step(list(sequences), [len(s) for s in sequences.values()])
    positions = torch.cat([torch.arange(len(s)) for s in sequences.values()])
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(list(sequences.values())), positions, cache, attn))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ragged_prefill_logits_match_transformers(checkpoint, variant):
    path = checkpoint(variant)
    model = load_target(path)
    # 150 > original_max_position_embeddings: positions past YaRN's original context are covered.
    prompts = _prompts(model.config.vocab_size, [7, 1, 150, 3])
    ours = _forward_logits(model, {f"r{i}": p for i, p in enumerate(prompts)})
    hf = _hf(path)
    with torch.no_grad():
        expected = torch.cat([hf(p[None]).logits[0].float() for p in prompts])
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)


def _merged_expert_name(name: str) -> str:
    """Our per-expert names (the checkpoint's) → transformers' stacked expert tensors."""
    name = re.sub(r"experts\.\d+\.(gate|up)_proj\.weight$", "experts.gate_up_proj", name)
    return re.sub(r"experts\.\d+\.down_proj\.weight$", "experts.down_proj", name)


def test_parameter_names_equal_transformers_up_to_stacked_experts(checkpoint):
    path = checkpoint()
    with torch.device("meta"):  # as the loader builds it, before its projections are fused
        built = DeepseekV3Target(load_config(path))
    ours = {_merged_expert_name(name) for name, _ in built.named_parameters()}
    hf = _hf(path)
    theirs = {name for name, _ in hf.named_parameters()}
    theirs |= {name for name, _ in hf.named_buffers() if name.endswith("e_score_correction_bias")}
    assert ours == theirs


def test_absorbed_decode_path_equals_expanded_path(checkpoint):
    """Forcing every request onto one MLA path or the other gives the same logits."""
    model = load_target(checkpoint())
    prompts = _prompts(model.config.vocab_size, [40, 5, 17], seed=4)
    results = []
    for threshold in (0, 1 << 20):  # 0: always expanded, huge: always absorbed
        for layer in model.layers:
            layer.self_attn.absorb_max_query_len = threshold
        cache = model.make_kv_cache(num_blocks=64, block_size=4)
        prefill = _forward_logits(model, {f"r{i}": p[:-3] for i, p in enumerate(prompts)}, cache)
        decode = _forward_logits_at(model, cache, {f"r{i}": p for i, p in enumerate(prompts)}, start=-3)
        results.append(torch.cat([prefill, decode]))
    torch.testing.assert_close(results[0], results[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_queries", [1, 4])
def test_absorbed_attention_equals_expanded_on_random_latents(num_queries):
    g = torch.Generator().manual_seed(num_queries)
    heads, nope, rope, v, rank, context_len = 3, 5, 4, 7, 11, 9  # odd sizes, v_head != qk_nope
    q_nope, q_pe = (
        torch.randn(num_queries, heads, nope, generator=g),
        torch.randn(num_queries, heads, rope, generator=g),
    )
    context = torch.randn(context_len, rank + rope, generator=g)
    kv_b_weight = torch.randn(heads * (nope + v), rank, generator=g)
    cache_index = torch.arange(context_len)
    mask = cache_index[None, :] <= torch.arange(context_len - num_queries, context_len)[:, None]
    mask = mask if num_queries > 1 else None
    expanded = attend_expanded(q_nope, q_pe, context, kv_b_weight, 0.3, mask)
    assert expanded.shape == (num_queries, heads, v)
    torch.testing.assert_close(attend_absorbed(q_nope, q_pe, context, kv_b_weight, 0.3, mask), expanded)


def _forward_logits_at(model, cache, sequences: dict[str, torch.Tensor], start: int) -> torch.Tensor:
    """Runs each sequence's tokens from `start` on, on top of what the cache already holds."""
    attn = cache.prepare_step(list(sequences), [len(s[start:]) for s in sequences.values()])
    ids = torch.cat([s[start:] for s in sequences.values()])
    positions = torch.cat([torch.arange(len(s))[start:] for s in sequences.values()])
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, cache, attn))


def test_ragged_steps_with_rollbacks_match_full_forward(checkpoint):
    model = load_target(checkpoint())
    cache = model.make_kv_cache(num_blocks=48, block_size=4)
    g = torch.Generator().manual_seed(1)
    sequences: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def step(new_tokens: dict[str, int], rollback: dict[str, int] | None = None) -> None:
        for req_id, keep in (rollback or {}).items():
            cache.truncate(req_id, keep)
            del sequences[req_id][keep:]
        req_ids = list(new_tokens)
        starts = [cache.num_tokens(r) for r in req_ids]
        for r in req_ids:
            sequences[r] += torch.randint(0, model.config.vocab_size, (new_tokens[r],), generator=g).tolist()
        attn = cache.prepare_step(req_ids, [new_tokens[r] for r in req_ids])
        ids = torch.tensor([t for r, s in zip(req_ids, starts) for t in sequences[r][s:]])
        positions = torch.cat([torch.arange(s, len(sequences[r])) for r, s in zip(req_ids, starts)])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, cache, attn))
        row = 0
        for r, s in zip(req_ids, starts):
            n = len(sequences[r]) - s
            expected = _forward_logits(model, {"full": torch.tensor(sequences[r])})[s:]
            torch.testing.assert_close(logits[row : row + n], expected, atol=ATOL, rtol=0)
            row += n
        for r, tokens in sequences.items():
            assert cache.num_tokens(r) == len(tokens)

    # The tiny config's break-even is 32 new tokens: prefills of 40 and 33 take the expanded path,
    # everything else the absorbed one.
    step({"a": 40, "b": 3})
    step({"b": 33, "a": 4, "c": 5})  # chunk + verify-like step of last token + 3 drafts + new prompt
    step({"a": 3, "c": 3}, rollback={"a": 41})  # 3 drafts of a rejected: roll back, re-verify
    step({"a": 1, "b": 4, "c": 2}, rollback={"b": 34, "c": 5})  # rollback across a block boundary
    step({"a": 35}, rollback={"a": 0})  # full rollback and re-prefill is just another step


def test_latent_cache_holds_the_compressed_size_per_token(checkpoint):
    model = load_target(checkpoint())
    config = model.config
    cache = model.make_kv_cache(num_blocks=6, block_size=4)
    latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
    assert cache.latent.shape == (config.num_hidden_layers, 6, 4, latent_dim)
    assert cache.bytes_per_token == latent_dim * cache.latent.element_size() * config.num_hidden_layers
    total = sum(t.nbytes for t in vars(cache).values() if isinstance(t, torch.Tensor))
    assert total == cache.bytes_per_token * 6 * 4  # no other (expanded) tensor hides in the cache
    expanded = config.num_attention_heads * (config.qk_head_dim + config.v_head_dim)
    assert latent_dim < expanded  # per token and layer: 40 vs 160 values here, 576 vs 40,960 in V3


def test_bfloat16_load_keeps_the_router_in_float32(checkpoint):
    model = load_target(checkpoint(), dtype=torch.bfloat16)
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    experts = model.layers[1].mlp.experts  # stacked at load
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.bfloat16
    assert model.make_kv_cache(2, 4).latent.dtype == torch.bfloat16
    logits = _forward_logits(model, {"a": torch.arange(5)})
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_config_reads_mla_moe_and_yarn_fields(checkpoint):
    config = load_config(checkpoint())
    assert isinstance(config, DeepseekV3Config) and config.has_mtp
    assert config.kv_cache_dim == config.kv_lora_rank + config.qk_rope_head_dim == 40
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["factor"] == 4.0
    assert config.rope_interleave and config.first_k_dense_replace == 1 and config.n_group == 2
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]  # layer 3: the MTP layer


@pytest.mark.parametrize(
    "change,message",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"quantization_config": {"quant_method": "fp8"}}, "per-tensor FP8"),
        ({"n_group": 3}, "groups of >= 2 experts"),
    ],
)
def test_unimplemented_deepseek_variants_are_rejected(checkpoint, tmp_path, change, message):
    path = tmp_path / "variant"
    shutil.copytree(checkpoint(), path)
    config = json.loads((path / "config.json").read_text()) | change
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_target(path)
