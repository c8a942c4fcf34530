"""config.json is read by specsplit itself (`specsplit.models.config.read_hf_config`), so that the services never
import transformers: every family must read exactly as transformers' configuration classes read it. Checked
against transformers on the tiny checkpoints' configs, on each of them with one key left out (a checkpoint's
config.json may leave out what transformers' class fills in), and on the RoPE forms checkpoints ship."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers

from specsplit.models.config import ModelConfig
from specsplit.models.deepseek_v3 import DeepseekV3Config
from specsplit.models.glm4_moe import Glm4MoeConfig
from specsplit.models.loader import load_config
from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_checkpoint
from tests.fixtures.tiny_glm4_moe import write_tiny_glm4_moe_checkpoint

FAMILIES = ("llama", "qwen2", "qwen3", "mimo", "deepseek_v3", "glm4_moe")
RECORDS = {"DeepseekV3ForCausalLM": DeepseekV3Config, "Glm4MoeForCausalLM": Glm4MoeConfig}
# MiMo's model_type is known to transformers only through trust_remote_code: its config is a Qwen2Config.
MIMO_ONLY_KEYS = ("model_type", "auto_map", "architectures", "transformers_version")


@pytest.fixture(scope="module")
def base_config(checkpoint_dir, tmp_path_factory):
    """base_config(family) → the config.json dict of that family's tiny checkpoint."""
    written = {}

    def make(family: str) -> dict:
        if family not in written:
            if family == "deepseek_v3":
                path = write_tiny_deepseek_checkpoint(tmp_path_factory.mktemp("deepseek"), num_hidden_layers=2)
            elif family == "glm4_moe":
                path = write_tiny_glm4_moe_checkpoint(tmp_path_factory.mktemp("glm"))
            else:
                path = checkpoint_dir(family)
            written[family] = json.loads((path / "config.json").read_text())
        return dict(written[family])

    return make


def transformers_reading(path):
    raw = json.loads((path / "config.json").read_text())
    if raw.get("architectures") == ["MiMoForCausalLM"]:
        return transformers.Qwen2Config(**{k: v for k, v in raw.items() if k not in MIMO_ONLY_KEYS})
    return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)


def outcome(read):
    try:
        return read()
    except Exception as err:  # noqa: BLE001 (compared: both readings must refuse the same config)
        return type(err).__name__


def assert_reads_as_transformers(path, raw: dict) -> bool:
    """True where both refuse the config."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    ours = outcome(lambda: load_config(path))
    architecture = raw["architectures"][0]
    record = RECORDS.get(architecture, ModelConfig)
    theirs = outcome(lambda: record.from_pretrained(path, hf=transformers_reading(path)))
    if isinstance(ours, str) or isinstance(theirs, str):  # a refusal: both refuse (their messages differ)
        assert isinstance(ours, str) and isinstance(theirs, str), (ours, theirs)
        return True
    assert ours == theirs
    return False


@pytest.mark.parametrize("family", FAMILIES)
def test_each_key_left_out_reads_as_transformers_reads_it(base_config, tmp_path, family):
    raw = base_config(family)
    assert not assert_reads_as_transformers(tmp_path / "whole", raw)
    refused = 0
    for key in raw:
        if key in ("architectures", "model_type"):  # what names the family (AutoConfig needs model_type)
            continue
        left_out = {k: v for k, v in raw.items() if k != key}
        refused += assert_reads_as_transformers(tmp_path / key, left_out)
    assert refused < len(raw) // 2  # most keys have a default: the comparison compared configs, not refusals


ROPE_FORMS = {
    "llama": [
        {"rope_theta": 500000.0},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {
            "original_max_position_embeddings": 128,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
        {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},  # refused: not implemented
    ],
    "qwen3": [{"rope_theta": 1000000.0}, {"rope_scaling": None, "rope_theta": 5000.0}],
    "deepseek_v3": [  # (the base config has DeepSeek-V3's own YaRN, its context lengths shrunk)
        {"rope_scaling": None},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_scaling": {"type": "yarn", "factor": 2.0}},
    ],
    "glm4_moe": [{"partial_rotary_factor": 1.0}, {"partial_rotary_factor": 0.25}, {"rope_theta": 1000000.0}],
}


@pytest.mark.parametrize(("family", "form"), [(f, i) for f, forms in ROPE_FORMS.items() for i in range(len(forms))])
def test_rope_forms_read_as_transformers_reads_them(base_config, tmp_path, family, form):
    raw = {**base_config(family), **ROPE_FORMS[family][form]}
    assert_reads_as_transformers(tmp_path / "config", raw)


def test_loading_a_model_never_imports_transformers(base_config, tmp_path):
    """The point of reading config.json ourselves: a verifier or drafter process does not pay for transformers."""
    for family in ("qwen3", "deepseek_v3", "glm4_moe"):
        (tmp_path / family).mkdir()
        (tmp_path / family / "config.json").write_text(json.dumps(base_config(family)))
    code = (
        "import sys; from specsplit.models.loader import load_config\n"
        f"for family in ('qwen3', 'deepseek_v3', 'glm4_moe'): load_config({str(tmp_path)!r} + '/' + family)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_config_written_by_transformers_reads_the_same(base_config, tmp_path):
    """transformers 5's `save_pretrained` writes its own form (`rope_parameters`, `dtype`, every default)."""
    for family in ("llama", "qwen2", "deepseek_v3", "glm4_moe"):
        whole = tmp_path / f"{family}-whole"
        whole.mkdir()
        (whole / "config.json").write_text(json.dumps(base_config(family)))
        saved = tmp_path / f"{family}-saved"
        transformers.AutoConfig.from_pretrained(str(whole)).save_pretrained(str(saved))
        assert "rope_parameters" in json.loads((saved / "config.json").read_text())
        assert load_config(saved) == load_config(whole), family
