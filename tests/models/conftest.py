"""Tiny checkpoints shared by the models tests (written once per session)."""

from __future__ import annotations

import json
import pathlib

import pytest
import transformers

from tests.fixtures.tiny import write_tiny_checkpoint

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mimo")


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """checkpoint_dir(architecture, **kwargs) → path of a tiny checkpoint, cached per arguments."""
    cache: dict[tuple, pathlib.Path] = {}

    def make(architecture: str = "llama", **kwargs) -> pathlib.Path:
        key = (architecture, *sorted(kwargs.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{architecture}")
            cache[key] = write_tiny_checkpoint(path, architecture=architecture, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) → transformers' own implementation of the checkpoint, fp32, eval."""
    return _load_hf_model


def _load_hf_model(path: pathlib.Path) -> transformers.PreTrainedModel:
    # MiMo's main model is a Qwen2; its model_type is only known with trust_remote_code.
    raw = json.loads((path / "config.json").read_text())
    if raw["architectures"] == ["MiMoForCausalLM"]:
        hidden = ("model_type", "architectures", "auto_map", "transformers_version")
        config = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k not in hidden})
        model = transformers.Qwen2ForCausalLM.from_pretrained(str(path), config=config)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    return model.float().eval()
