"""Loading checkpoints: only the needed tensors, shared weights preferred as documented, clear errors."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable

import pytest
import safetensors.torch
import torch

from specsplit.models.loader import load_mtp, load_target, load_tokenizer


def _edited_copy(src: pathlib.Path, dst: pathlib.Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> pathlib.Path:
    shutil.copytree(src, dst)
    tensors = safetensors.torch.load_file(str(dst / "model.safetensors"))
    edit(tensors)
    safetensors.torch.save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "nowhere"
    for load in (load_target, load_mtp, load_tokenizer):
        with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
            load(missing)


def test_directory_without_weights_is_rejected(checkpoint_dir, tmp_path):
    dst = tmp_path / "no-weights"
    shutil.copytree(checkpoint_dir("llama"), dst)
    (dst / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_target(dst)


def test_load_mtp_without_mtp_layers_says_so(checkpoint_dir):
    with pytest.raises(ValueError, match="no MTP weights"):
        load_mtp(checkpoint_dir("llama", num_nextn_predict_layers=0))


def test_missing_mtp_tensors_are_named(checkpoint_dir, tmp_path):
    def drop_mtp(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            del tensors[name]

    path = _edited_copy(checkpoint_dir("llama"), tmp_path / "no-mtp", drop_mtp)
    load_target(path)  # the target alone is fine
    with pytest.raises(ValueError, match=r"lacks tensors: .*model\.layers\.2\.enorm\.weight"):
        load_mtp(path)


def test_missing_target_tensor_is_named(checkpoint_dir, tmp_path):
    path = _edited_copy(
        checkpoint_dir("qwen2"), tmp_path / "holes", lambda t: t.pop("model.layers.1.self_attn.q_proj.bias")
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.bias"):
        load_target(path)


def test_shape_mismatch_is_named(checkpoint_dir, tmp_path):
    def shrink(tensors):
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()

    path = _edited_copy(checkpoint_dir("llama"), tmp_path / "shapes", shrink)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*shape \(10,\), expected \(64,\)"):
        load_target(path)


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint_dir, tmp_path):
    src = checkpoint_dir("qwen3")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = safetensors.torch.load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        safetensors.torch.save_file({n: tensors[n] for n in shard_names}, str(dst / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for load in (load_target, load_mtp):
        single, sharded = load(src).state_dict(), load(dst).state_dict()
        assert single.keys() == sharded.keys()
        assert all(torch.equal(single[k], sharded[k]) for k in single)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_target(dst)


def test_weights_are_cast_to_the_requested_dtype(checkpoint_dir):
    model = load_target(checkpoint_dir("llama"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    cache = model.make_kv_cache(4, 4)
    assert cache.k.dtype == torch.bfloat16
    with torch.no_grad():
        hidden = model(torch.tensor([1, 2, 3]), torch.arange(3), cache, cache.prepare_step(["a"], [3]))
    assert hidden.dtype == torch.bfloat16 and model.compute_logits(hidden).dtype == torch.float32


def test_mtp_prefers_the_target_embedding_and_its_own_head(checkpoint_dir, tmp_path):
    src = checkpoint_dir("llama")

    def diverge(tensors):
        tensors["model.layers.2.embed_tokens.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
        tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"] + 1.0

    raw = safetensors.torch.load_file(str(src / "model.safetensors"))
    mtp = load_mtp(_edited_copy(src, tmp_path / "diverged", diverge))
    assert torch.equal(mtp.embed_tokens.weight, raw["model.embed_tokens.weight"])
    assert torch.equal(mtp.shared_head.head.weight, raw["lm_head.weight"] + 1.0)

    mtp = load_mtp(_edited_copy(src, tmp_path / "headless", lambda t: t.pop("model.layers.2.shared_head.head.weight")))
    assert torch.equal(mtp.shared_head.head.weight, raw["lm_head.weight"])


@pytest.mark.parametrize("architecture", ["llama", "mimo"])
def test_tied_mtp_head_is_the_shared_embedding(checkpoint_dir, architecture):
    mtp = load_mtp(checkpoint_dir(architecture, tie_word_embeddings=True))
    assert mtp.shared_head.head.weight is mtp.embed_tokens.weight


def test_mimo_mtp_uses_the_target_lm_head(checkpoint_dir):
    path = checkpoint_dir("mimo")
    raw = safetensors.torch.load_file(str(path / "model.safetensors"))
    mtp = load_mtp(path)
    assert torch.equal(mtp.shared_head.head.weight, raw["lm_head.weight"])
    assert torch.equal(mtp.shared_head.norm.weight, raw["model.mtp_layers.0.final_layernorm.weight"])
    assert torch.equal(mtp.eh_proj.weight, raw["model.mtp_layers.0.input_proj.weight"])


def test_loaded_models_hold_no_meta_tensors(checkpoint_dir):
    path = checkpoint_dir("qwen2")
    for model in (load_target(path), load_mtp(path)):
        assert all(not p.is_meta for p in model.parameters())
        assert all(not p.requires_grad for p in model.parameters())
