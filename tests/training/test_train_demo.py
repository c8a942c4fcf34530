"""A tiny end-to-end training run: the checkpoint it writes is what other code loads."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, LlamaForCausalLM

from specsplit.training.checkpoint import load_checkpoint
from specsplit.training.train_demo import main

MTP_NAMES = {
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}
TINY = [
    "--vocab-size", "300", "--hidden-size", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1",
    "--intermediate-size", "64", "--seq-len", "32", "--batch-size", "4", "--warmup", "5", "--lr", "3e-3",
    "--eval-every", "15", "--log-every", "10", "--valid-max-tokens", "512", "--heldout-max-tokens", "512",
    "--spec-prompts", "2", "--spec-prompt-len", "16", "--spec-new-tokens", "8",
]  # fmt: skip


def make_corpus(root):
    for i in range(12):
        functions = [
            f"def func_{i}_{j}(value, count={j}):\n"
            f'    """Return {j} multiples of value."""\n'
            "    result = []\n"
            "    for index in range(count):\n"
            f"        result.append(value * index + {i})\n"
            "    return result\n\n\n"
            for j in range(12)
        ]
        (root / f"mod{i:02d}.py").write_text("".join(functions))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib")
    make_corpus(root)
    return root, tmp_path_factory.mktemp("data")


def train(corpus, out, *extra):
    root, data_dir = corpus
    assert main(["--stdlib", str(root), "--data-dir", str(data_dir), "--out", str(out), *TINY, *extra]) == 0
    return out


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    return train(corpus, tmp_path_factory.mktemp("ckpt"), "--steps", "30")


def test_config_loads_with_autoconfig_and_declares_one_mtp_layer(checkpoint):
    config = AutoConfig.from_pretrained(str(checkpoint))
    assert config.model_type == "llama"
    assert config.num_nextn_predict_layers == 1
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, 1)
    assert json.loads((checkpoint / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_target_loads_with_llama_for_causal_lm_and_matches_the_training_module(checkpoint):
    hf = LlamaForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    ours = load_checkpoint(checkpoint)
    ids = torch.randint(2, 300, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.target_forward(ids)[1])


def test_mtp_tensors_have_the_deepseek_names(checkpoint):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    prefix = "model.layers.2."
    assert {k[len(prefix) :] for k in tensors if k.startswith(prefix)} == MTP_NAMES
    assert not any(k.startswith("model.layers.3.") or k.startswith("lm_head") for k in tensors)
    assert tensors[prefix + "eh_proj.weight"].shape == (32, 64)  # [H, 2H]
    assert torch.equal(tensors[prefix + "shared_head.head.weight"], tensors["model.embed_tokens.weight"])
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


def test_training_lowers_the_loss_and_reports_heldout_numbers(checkpoint):
    report = json.loads((checkpoint / "metrics.json").read_text())
    assert report["final_train_next_loss"] < report["first_train_next_loss"] - 1.0
    history = report["valid_history"]
    assert history[-1]["valid_next"] < history[0]["valid_next"]
    spec = report["heldout"]["speculative_greedy"]
    assert len(spec["acceptance"]) == 3 and spec["iterations"] > 0
    heldout = (checkpoint / "heldout_files.txt").read_text().split()
    assert len(heldout) == 1 and heldout[0].startswith("mod")
    assert "Held-out numbers" in (checkpoint / "README.md").read_text()


def test_same_seed_gives_the_same_weights_on_cpu(corpus, tmp_path):
    first = train(corpus, tmp_path / "a", "--steps", "6", "--no-measure")
    second = train(corpus, tmp_path / "b", "--steps", "6", "--no-measure")
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
