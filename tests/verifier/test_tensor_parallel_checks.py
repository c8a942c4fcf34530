"""`serve verifier --tensor-parallel-size N` start-up mistakes, each one line before any rank starts: a
checkpoint whose heads, KV heads or experts do not split into N, an FP8 checkpoint a rank would hold part of a
scale block of, another quantization, too few GPUs."""

from __future__ import annotations

import json

import pytest

from specsplit.client.errors import UsageError
from specsplit.runtime.serve_options import ModelOptions
from specsplit.runtime.start_up_checks import check_tensor_parallel
from tests.fixtures.tiny import write_tiny_checkpoint
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint


def options(path, device: str = "cpu") -> ModelOptions:
    return ModelOptions(str(path), device, "float32", "auto", False, 0.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):  # 4 heads, 2 KV heads, MLP 128
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llama"), architecture="llama")


def test_sizes_that_split_the_checkpoint_pass(llama):
    for size in (1, 2, 4):  # 4 > 2 KV heads: replicated
        check_tensor_parallel(options(llama), size)


def test_heads_that_do_not_split_are_refused(llama):
    with pytest.raises(UsageError, match=r"num_attention_heads \(4\) does not divide into 3 ranks"):
        check_tensor_parallel(options(llama), 3)
    with pytest.raises(UsageError, match=r"num_attention_heads \(4\) does not divide into 8 ranks"):
        check_tensor_parallel(options(llama), 8)


def test_kv_heads_that_cannot_be_replicated_evenly_are_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path, architecture="llama", num_attention_heads=8, num_key_value_heads=4)
    check_tensor_parallel(options(path), 8)  # each KV head on 2 ranks
    raw = json.loads((path / "config.json").read_text())
    raw.update(num_attention_heads=12, num_key_value_heads=3, hidden_size=96, intermediate_size=192)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match="3 KV heads cannot be replicated evenly over 4 ranks"):
        check_tensor_parallel(options(path), 4)


def test_experts_that_do_not_split_are_refused(tmp_path):
    path = write_tiny_deepseek_checkpoint(tmp_path, n_routed_experts=6, n_group=3, topk_group=1, num_attention_heads=4)
    check_tensor_parallel(options(path), 2)
    with pytest.raises(UsageError, match=r"n_routed_experts \(6\) does not divide into 4 ranks"):
        check_tensor_parallel(options(path), 4)


def test_glm4_moe_splits_like_the_others(tmp_path):  # 4 heads, 2 KV heads, dense MLP 128, 6 experts
    path = write_tiny_glm4_moe_checkpoint(tmp_path, n_routed_experts=6, n_group=3, topk_group=1)
    check_tensor_parallel(options(path), 2)
    with pytest.raises(UsageError, match=r"n_routed_experts \(6\) does not divide into 4 ranks"):
        check_tensor_parallel(options(path), 4)


def test_an_fp8_checkpoint_splits_along_whole_scale_blocks_only(tmp_path):
    path = write_tiny_checkpoint(tmp_path, architecture="llama")  # head_dim 16, 2 KV heads, MLP 128
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 32]}
    (path / "config.json").write_text(json.dumps(raw))
    check_tensor_parallel(options(path), 2)  # a KV head's 16 rows, 2 heads' 32 columns of o_proj, 64 of the MLP
    with pytest.raises(UsageError, match=r"a rank's o_proj columns \(16\) are not whole blocks of 32") as err:
        check_tensor_parallel(options(path), 4)
    assert "\n" not in str(err.value)
    raw["quantization_config"]["weight_block_size"] = [128, 128]  # the shipped blocks: a tiny model is one
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match=r"query rows \(32\) are not whole blocks of 128"):
        check_tensor_parallel(options(path), 2)
    check_tensor_parallel(options(path), 1)  # one device: not this check's business
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}  # refused for any size, in one line too
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UsageError, match="quant_method 'awq'.* is not supported") as err:
        check_tensor_parallel(options(path), 2)
    assert "\n" not in str(err.value)


def test_too_few_gpus_are_refused(llama, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_tensor_parallel(options(llama, "cuda:0"), 2)
    with pytest.raises(UsageError, match="needs 2 CUDA devices from there, this process sees 2"):
        check_tensor_parallel(options(llama, "cuda:1"), 2)


def test_the_fp8_benchmark_shapes_split_along_whole_blocks(tmp_path):
    """benchmarks/lib/shapes.py's FP8 shapes (blocks of 128) split at TP 2, 4 and 8, GLM-4.5-Air's MLPs (10944 and
    1408 wide: 85.5 and 11 blocks) in whole blocks as evenly as they go; at TP 16 its shared expert's 11 blocks
    would leave a rank none: refused in one line."""
    from benchmarks.lib.shapes import write_shape

    for shape in ("qwen2-7b-fp8", "glm-4.5-air-fp8"):
        path = write_shape(shape, tmp_path / shape)
        for size in (2, 4) if shape.startswith("qwen2") else (2, 4, 8):
            check_tensor_parallel(ModelOptions(str(path), "cpu", "bfloat16", "dummy", False, 0.0), size)
    glm = ModelOptions(str(tmp_path / "glm-4.5-air-fp8"), "cpu", "bfloat16", "dummy", False, 0.0)
    with pytest.raises(UsageError, match=r"shared experts \(1408 wide: 11 blocks of 128\) would be empty") as err:
        check_tensor_parallel(glm, 16)
    assert "\n" not in str(err.value)
