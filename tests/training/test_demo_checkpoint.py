"""The checkpoint shipped in checkpoints/demo keeps the contract other code loads it by."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from specsplit.training.checkpoint import load_checkpoint

DEMO = Path(__file__).resolve().parents[2] / "checkpoints" / "demo"
pytestmark = pytest.mark.skipif(not (DEMO / "model.safetensors").exists(), reason="no demo checkpoint")


def test_demo_checkpoint_fits_in_25_mb():
    assert sum(f.stat().st_size for f in DEMO.iterdir()) <= 25_000_000


def test_demo_checkpoint_loads_as_llama_with_one_deepseek_mtp_layer():
    config = AutoConfig.from_pretrained(str(DEMO))
    assert config.num_nextn_predict_layers == 1
    prefix = f"model.layers.{config.num_hidden_layers}."
    with safe_open(str(DEMO / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {prefix + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight")} <= names
    assert {prefix + "shared_head.norm.weight", prefix + "shared_head.head.weight"} <= names
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO))
    ids = torch.tensor([tokenizer.encode("def main():\n    return 0\n")])
    hf = LlamaForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_checkpoint(DEMO).target_forward(ids)[1])


def test_heldout_file_list_names_stdlib_files():
    heldout = (DEMO / "heldout_files.txt").read_text().split()
    assert len(heldout) > 50 and all(name.endswith(".py") for name in heldout)
