"""Our TargetModel gives transformers' logits on the same checkpoint (fp32, ragged prefill batch)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specsplit.models.layers import FUSED_PROJECTIONS
from specsplit.models.loader import load_config, load_target
from specsplit.models.target import TargetModel

ATOL = 1e-4


def _ragged_prefill_logits(model, prompts: list[torch.Tensor]) -> torch.Tensor:
    cache = model.make_kv_cache(num_blocks=32, block_size=4)
    attn = cache.prepare_step([f"r{i}" for i in range(len(prompts))], [len(p) for p in prompts])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        return model.compute_logits(model(torch.cat(prompts), positions, cache, attn))


def _hf_logits(hf, prompts: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf(p[None]).logits[0].float() for p in prompts])


def _prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mimo"])
@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_ragged_prefill_logits_match_transformers(checkpoint_dir, hf_model, architecture, tie_word_embeddings):
    path = checkpoint_dir(architecture, tie_word_embeddings=tie_word_embeddings)
    model = load_target(path)
    prompts = _prompts(model.config.vocab_size, [7, 1, 13, 4])
    ours = _ragged_prefill_logits(model, prompts)
    assert ours.dtype == torch.float32 and ours.shape == (25, model.config.vocab_size)
    torch.testing.assert_close(ours, _hf_logits(hf_model(path), prompts), atol=ATOL, rtol=0)


def test_tied_lm_head_is_the_embedding(checkpoint_dir):
    model = load_target(checkpoint_dir("llama", tie_word_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight


def _fused_name(name: str) -> str:
    for fused, parts in FUSED_PROJECTIONS.items():
        for part in parts:
            name = name.replace(f".{part}.", f".{fused}.")
    return name


def test_parameter_names_equal_transformers(checkpoint_dir, hf_model):
    """The model the loader fills has transformers' names; the one it returns has them fused."""
    path = checkpoint_dir("qwen3")
    hf_names = {name for name, _ in hf_model(path).named_parameters()}
    with torch.device("meta"):
        built = TargetModel(load_config(path))
    assert {name for name, _ in built.named_parameters()} == hf_names
    assert {name for name, _ in load_target(path).named_parameters()} == {_fused_name(n) for n in hf_names}


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["linear", "llama3"],
)
def test_scaled_rope_logits_match_transformers(checkpoint_dir, hf_model, tmp_path, rope_scaling):
    path = tmp_path / "scaled"
    shutil.copytree(checkpoint_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(rope_scaling=rope_scaling, rope_theta=500000.0)
    (path / "config.json").write_text(json.dumps(config))
    model = load_target(path)
    assert model.config.rope_scaling["rope_type"] == rope_scaling["rope_type"]
    # Long enough prompts that positions pass original_max_position_embeddings.
    prompts = _prompts(model.config.vocab_size, [70, 9])
    torch.testing.assert_close(
        _ragged_prefill_logits(model, prompts), _hf_logits(hf_model(path), prompts), atol=ATOL, rtol=0
    )


def test_misshapen_token_inputs_are_rejected(checkpoint_dir):
    model = load_target(checkpoint_dir("llama"))
    cache = model.make_kv_cache(num_blocks=4, block_size=4)
    attn = cache.prepare_step(["a"], [2])
    with pytest.raises(ValueError, match=r"must both be \[num_tokens\]"):
        model(torch.tensor([[1, 2]]), torch.arange(2), cache, attn)
    with pytest.raises(ValueError, match="3 query tokens but the attention metadata describes 2"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), cache, attn)
