"""Which architecture a checkpoint is read as: `model_type` when config.json lists no `architectures`,
the first supported one when it lists several, and a clear error naming the supported ones otherwise."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
import transformers

from specsplit.models.config import UnsupportedArchitectureError, checkpoint_architecture
from specsplit.models.loader import ARCHITECTURES, load_config, load_mtp, load_target
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint


def _with_config(src: pathlib.Path, dst: pathlib.Path, **changes) -> pathlib.Path:
    """A copy of checkpoint `src` whose config.json has `changes` (None: the key removed)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    cache = model.make_kv_cache(num_blocks=16, block_size=4)
    tokens, new = list(prompt), list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            start = len(tokens) - len(new)
            attn = cache.prepare_step(["r"], [len(new)])
            hidden = model(torch.tensor(new), torch.arange(start, len(tokens)), cache, attn)
            new = [int(model.compute_logits(hidden[-1:]).argmax())]
            tokens += new
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek"), num_hidden_layers=2)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mimo"])
def test_missing_architectures_reads_the_same_config_through_model_type(checkpoint_dir, tmp_path, architecture):
    listed = checkpoint_dir(architecture)
    unlisted = _with_config(listed, tmp_path / "unlisted", architectures=None)
    assert load_config(unlisted) == load_config(listed)


def test_missing_architectures_reads_deepseek_v3_through_model_type(deepseek_dir, tmp_path):
    unlisted = _with_config(deepseek_dir, tmp_path / "unlisted", architectures=None)
    config = load_config(unlisted)
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert config == load_config(deepseek_dir)


def test_config_saved_by_transformers_without_architectures_loads_and_generates_the_same(checkpoint_dir, tmp_path):
    listed = checkpoint_dir("qwen2")
    unlisted = tmp_path / "saved"
    shutil.copytree(listed, unlisted)
    hf_config = transformers.AutoConfig.from_pretrained(str(listed))
    hf_config.architectures = None
    hf_config.save_pretrained(str(unlisted))
    assert "architectures" not in json.loads((unlisted / "config.json").read_text())

    prompt = [5, 17, 99, 250, 3]
    assert _greedy(load_target(unlisted), prompt, 8) == _greedy(load_target(listed), prompt, 8)
    assert load_mtp(unlisted).config == load_mtp(listed).config


def test_deepseek_v3_without_architectures_generates_the_same(deepseek_dir, tmp_path):
    unlisted = _with_config(deepseek_dir, tmp_path / "unlisted", architectures=None)
    prompt = [5, 17, 99, 250, 3]
    assert _greedy(load_target(unlisted), prompt, 4) == _greedy(load_target(deepseek_dir), prompt, 4)


@pytest.mark.parametrize(
    "listed,expected",
    [
        (["GPT2LMHeadModel", "Qwen2ForCausalLM"], "Qwen2ForCausalLM"),
        (["Qwen2ForCausalLM", "LlamaForCausalLM"], "Qwen2ForCausalLM"),
        (["LlamaForCausalLM", "Qwen2ForCausalLM"], "LlamaForCausalLM"),
        (["MiMoForCausalLM", "DeepseekV3ForCausalLM"], "MiMoForCausalLM"),
        (["Qwen2ForSequenceClassification", "DeepseekV3ForCausalLM"], "DeepseekV3ForCausalLM"),
    ],
)
def test_several_architectures_pick_the_first_supported(listed, expected):
    raw = {"architectures": listed, "model_type": "qwen2"}
    assert checkpoint_architecture(pathlib.Path("ckpt"), raw, ARCHITECTURES) == expected


def test_several_architectures_load_as_the_first_supported(checkpoint_dir, tmp_path):
    path = _with_config(
        checkpoint_dir("qwen3"),
        tmp_path / "several",
        architectures=["Qwen3Model", "Qwen3ForCausalLM", "LlamaForCausalLM"],
    )
    config = load_config(path)
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel'"),
        (
            {"architectures": ["LlamaForSequenceClassification", "LlamaModel"]},
            "architectures 'LlamaForSequenceClassification', 'LlamaModel'",
        ),
        ({"architectures": None, "model_type": "gpt2"}, r"model_type 'gpt2' \(no architectures listed\)"),
        ({"architectures": [], "model_type": None}, r"model_type None \(no architectures listed\)"),
    ],
)
def test_no_supported_architecture_names_the_supported_ones(checkpoint_dir, tmp_path, changes, named):
    path = _with_config(checkpoint_dir("llama"), tmp_path / "unsupported", **changes)
    with pytest.raises(UnsupportedArchitectureError, match=f"unsupported {named} in .*config.json") as caught:
        load_config(path)
    assert isinstance(caught.value, ValueError)
    message = str(caught.value)
    assert message.endswith("supported: " + ", ".join(ARCHITECTURES))
    assert "LlamaForCausalLM" in message and "DeepseekV3ForCausalLM" in message
