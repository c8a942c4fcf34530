"""ModelConfig.from_pretrained normalises Llama, Qwen2, Qwen3 and MiMo configs."""

from __future__ import annotations

import json
import shutil

import pytest

from specsplit.models.config import ModelConfig


def _edited_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "architecture,expected",
    [
        (
            "llama",
            {
                "architecture": "LlamaForCausalLM",
                "attention_bias": False,
                "o_proj_bias": False,
                "qk_norm": False,
            },
        ),
        (
            "qwen2",
            {
                "architecture": "Qwen2ForCausalLM",
                "attention_bias": True,
                "o_proj_bias": False,
                "qk_norm": False,
            },
        ),
        (
            "qwen3",
            {
                "architecture": "Qwen3ForCausalLM",
                "attention_bias": False,
                "o_proj_bias": False,
                "qk_norm": True,
            },
        ),
        (
            "mimo",
            {
                "architecture": "MiMoForCausalLM",
                "model_type": "mimo",
                "attention_bias": True,
                "qk_norm": False,
            },
        ),
    ],
)
def test_architecture_specific_fields(checkpoint_dir, architecture, expected):
    config = ModelConfig.from_pretrained(checkpoint_dir(architecture))
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (320, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.num_nextn_predict_layers == 1 and config.has_mtp
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert config.eos_token_ids == [1] and config.torch_dtype == "float32"
    assert config.tie_word_embeddings is False


def test_missing_mtp_count_means_no_mtp(checkpoint_dir):
    config = ModelConfig.from_pretrained(checkpoint_dir("llama", num_nextn_predict_layers=0))
    assert config.num_nextn_predict_layers == 0 and not config.has_mtp


def test_eos_ids_come_from_generation_config_first(checkpoint_dir, tmp_path):
    path = _edited_config(checkpoint_dir("llama"), tmp_path / "eos", eos_token_id=7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    assert ModelConfig.from_pretrained(path).eos_token_ids == [1, 5]
    (path / "generation_config.json").unlink()
    assert ModelConfig.from_pretrained(path).eos_token_ids == [7]


def test_rope_scaling_is_normalised(checkpoint_dir, tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    path = _edited_config(checkpoint_dir("llama"), tmp_path / "rope", rope_scaling=scaling, rope_theta=5e5)
    config = ModelConfig.from_pretrained(path)
    assert config.rope_theta == 5e5
    assert config.rope_scaling == scaling | {"original_max_position_embeddings": 512}


def test_unsupported_rope_type_is_rejected(checkpoint_dir, tmp_path):
    path = _edited_config(checkpoint_dir("llama"), tmp_path / "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_pretrained(path)


def test_unsupported_architecture_is_rejected(checkpoint_dir, tmp_path):
    path = _edited_config(checkpoint_dir("llama"), tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        ModelConfig.from_pretrained(path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
