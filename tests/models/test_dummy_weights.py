"""`load_format="dummy"`: models from config.json alone, seeded random weights, stable greedy output."""

from __future__ import annotations

import shutil

import pytest
import torch

from specsplit.models.loader import load_mtp, load_target


@pytest.fixture(scope="module")
def config_only(checkpoint_dir, tmp_path_factory):
    """A tiny checkpoint directory without any safetensors (untied head, DeepSeek MTP layout)."""
    dst = tmp_path_factory.mktemp("config-only") / "qwen2"
    shutil.copytree(checkpoint_dir("qwen2", vocab_size=1000, hidden_size=64, num_hidden_layers=3), dst)
    (dst / "model.safetensors").unlink()
    return dst


def _forward(model, token_ids: list[list[int]]) -> torch.Tensor:  # [total_tokens, vocab] float32
    cache = model.make_kv_cache(num_blocks=64, block_size=8)
    ids = [f"r{i}" for i in range(len(token_ids))]
    attn = cache.prepare_step(ids, [len(t) for t in token_ids])
    flat = torch.tensor([t for ts in token_ids for t in ts])
    positions = torch.tensor([p for ts in token_ids for p in range(len(ts))])
    with torch.inference_mode():
        return model.compute_logits(model(flat, positions, cache, attn))


def test_dummy_target_needs_no_safetensors_and_is_seeded(config_only):
    a = load_target(config_only, load_format="dummy")
    b = load_target(config_only, load_format="dummy")
    assert a.config.vocab_size == 1000 and len(a.layers) == 3
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.lm_head.weight.data_ptr() != a.embed_tokens.weight.data_ptr()  # untied stays untied
    assert torch.all(a.norm.weight == 1)
    assert a.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.05)


def test_dummy_mtp_shares_the_targets_embedding_and_head(config_only):
    target = load_target(config_only, load_format="dummy", dtype=torch.bfloat16)
    mtp = load_mtp(config_only, load_format="dummy", dtype=torch.bfloat16)
    assert mtp.eh_proj.weight.dtype == torch.bfloat16
    assert torch.equal(mtp.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(mtp.shared_head.head.weight, target.lm_head.weight)
    assert not torch.equal(mtp.block.self_attn.qkv_proj.weight, target.layers[0].self_attn.qkv_proj.weight)


def test_dummy_bf16_greedy_is_finite_and_does_not_depend_on_the_batch(config_only):
    model = load_target(config_only, load_format="dummy", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (17, 5, 30)]
    together = _forward(model, prompts)
    assert torch.isfinite(together).all()
    alone = torch.cat([_forward(model, [p]) for p in prompts])
    assert torch.equal(together.argmax(-1), alone.argmax(-1))
    # The argmax is decided by the last token: the same token in other contexts predicts the same.
    ctx = [[7, 3, 9, 42], [500, 42], [42]]
    rows = _forward(model, ctx).argmax(-1)
    assert rows[3] == rows[5] == rows[6]


def test_unknown_load_format_is_refused(config_only):
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        load_target(config_only, load_format="pt")
