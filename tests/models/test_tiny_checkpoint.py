"""The tiny checkpoint writer: complete, deterministic, and greedy decoding matches transformers."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch

from specsplit.models.loader import load_target, load_tokenizer
from tests.fixtures.tiny import main, write_tiny_checkpoint


def _names(path) -> set[str]:
    with safetensors.safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_deepseek_layout_mtp_tensors_are_written(checkpoint_dir):
    names = _names(checkpoint_dir("llama"))
    for leaf in (
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head.norm",
        "shared_head.head",
        "embed_tokens",
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.down_proj",
    ):
        assert f"model.layers.2.{leaf}.weight" in names, leaf
    assert not any(n.startswith("model.layers.3.") for n in names)


def test_mimo_layout_mtp_tensors_are_written(checkpoint_dir):
    path = checkpoint_dir("mimo")
    names = _names(path)
    for leaf in (
        "token_layernorm",
        "hidden_layernorm",
        "input_proj",
        "final_layernorm",
        "self_attn.q_proj",
        "mlp.gate_proj",
    ):
        assert f"model.mtp_layers.0.{leaf}.weight" in names, leaf
    assert "model.mtp_layers.0.self_attn.q_proj.bias" in names
    assert not any(n.startswith("model.layers.2.") for n in names)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mimo" and config["num_nextn_predict_layers"] == 1


def test_tied_checkpoint_has_no_lm_head(checkpoint_dir):
    names = _names(checkpoint_dir("qwen2", tie_word_embeddings=True))
    assert "lm_head.weight" not in names and "model.layers.2.shared_head.head.weight" not in names


def test_tokenizer_has_the_vocab_size_and_round_trips_text(checkpoint_dir):
    path = checkpoint_dir("llama")
    tokenizer = load_tokenizer(path)
    assert len(tokenizer) == 320
    text = "def greet(name):\n    return 'Grüße, ' + name  # 🙂"
    ids = tokenizer.encode(text)
    assert max(ids) < 320 and tokenizer.decode(ids) == text
    eos = json.loads((path / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer.eos_token_id == eos and tokenizer.decode([eos]) == tokenizer.eos_token


def test_too_small_vocab_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 259"):
        write_tiny_checkpoint(tmp_path, vocab_size=100)


def _greedy_ignoring_eos(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    cache = model.make_kv_cache(num_blocks=32, block_size=4)
    tokens, new = list(prompt), list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            start = len(tokens) - len(new)
            attn = cache.prepare_step(["r"], [len(new)])
            hidden = model(torch.tensor(new), torch.arange(start, len(tokens)), cache, attn)
            logits = model.compute_logits(hidden[-1:])
            logits[:, model.config.eos_token_ids] = float("-inf")  # as generate's min_new_tokens does
            new = [int(logits.argmax())]
            tokens += new
    return tokens[len(prompt) :]


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mimo"])
def test_greedy_decode_matches_transformers_generate(checkpoint_dir, hf_model, architecture):
    path = checkpoint_dir(architecture)
    prompt = load_tokenizer(path).encode("Speculative decoding is")
    hf = hf_model(path)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=2
        )[0, len(prompt) :].tolist()
    assert _greedy_ignoring_eos(load_target(path), prompt, 40) == expected


def test_cli_writes_a_loadable_checkpoint(tmp_path, capsys):
    main([str(tmp_path / "cli"), "--architecture", "qwen3", "--seed", "1", "--tie-word-embeddings"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    model = load_target(tmp_path / "cli")
    assert model.config.architecture == "Qwen3ForCausalLM" and model.config.tie_word_embeddings
