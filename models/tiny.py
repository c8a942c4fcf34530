"""Writes tiny, random, but complete Hugging Face checkpoints for tests and demos.

The directory holds config.json (loadable by transformers' Llama/Qwen2/Qwen3 classes; MiMo's config
as Xiaomi ships it), model.safetensors with target weights plus MTP layers (DeepSeek-V3 layout, or
MiMo's `model.mtp_layers.*` for "mimo"), generation_config.json and a byte-level BPE tokenizer.

Weights use std 0.15 (not 0.02) so the top-2 logits of greedy decoding are well separated and our
decode can be compared token for token with transformers' `generate`.

    python -m models.tiny DIR [--architecture llama|qwen2|qwen3|mimo] [--seed N] ...
"""

from __future__ import annotations

import argparse
import json
import pathlib

import safetensors.torch
import torch

from models.config import ModelConfig
from models.mtp import MTPModule
from models.target import TargetModel
from models.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, write_tiny_tokenizer

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mimo": ("MiMoForCausalLM", "mimo"),
}
WEIGHT_STD = 0.15


def write_tiny_checkpoint(
    path: str | pathlib.Path,
    *,
    architecture: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    num_nextn_predict_layers: int = 1,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> pathlib.Path:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch_class, model_type = ARCHITECTURES[architecture]
    config_json = {
        "architectures": [arch_class],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": hidden_size // num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": architecture == "mimo",  # Qwen2 has qkv bias regardless; MiMo writes it out
        "use_sliding_window": False,
        "num_nextn_predict_layers": num_nextn_predict_layers,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "torch_dtype": "float32",
    }
    _write_json(path / "config.json", config_json)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID},
    )
    write_tiny_tokenizer(path, vocab_size, max_position_embeddings)
    config = ModelConfig.from_pretrained(path)
    generator = torch.Generator().manual_seed(seed)
    tensors = _target_tensors(config, generator)
    for layer in range(num_nextn_predict_layers):
        tensors.update(_mtp_tensors(config, layer, tensors, generator))
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _random(shape: tuple[int, ...], name: str, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):  # RMSNorm scales near 1, not exactly 1, so a wrong norm shows
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.1 * noise
    return WEIGHT_STD * noise


def _target_tensors(config: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = TargetModel(config)
    # named_parameters drops the tied lm_head, as transformers' save_pretrained does.
    return {name: _random(tuple(p.shape), name, generator) for name, p in model.named_parameters()}


def _mtp_tensors(
    config: ModelConfig, layer: int, target: dict[str, torch.Tensor], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        mtp = MTPModule(config)
    tensors: dict[str, torch.Tensor] = {}
    prefix = mtp.layout.prefix(config, layer)
    for name, p in mtp.named_parameters():
        own = [n for n in mtp.layout.checkpoint_candidates(config, name, layer) if n.startswith(prefix)]
        if not own:
            continue  # lives only in the target (MiMo's embedding and head)
        if name == "embed_tokens.weight":  # DeepSeek-V3 stores a copy of the shared embedding
            tensors[own[0]] = target["model.embed_tokens.weight"].clone()
        elif name == "shared_head.head.weight":  # …and of the LM head, unless the head is tied
            if not config.tie_word_embeddings:
                tensors[own[0]] = target["lm_head.weight"].clone()
        else:
            tensors[own[0]] = _random(tuple(p.shape), own[0], generator)
    return tensors


def _write_json(file: pathlib.Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random HF checkpoint with MTP weights.")
    parser.add_argument("path", type=pathlib.Path)
    parser.add_argument("--architecture", default="llama", choices=sorted(ARCHITECTURES))
    parser.add_argument("--vocab-size", type=int, default=320)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--num-hidden-layers", type=int, default=2)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-key-value-heads", type=int, default=2)
    parser.add_argument("--num-nextn-predict-layers", type=int, default=1)
    parser.add_argument("--max-position-embeddings", type=int, default=512)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = vars(parser.parse_args(argv))
    path = write_tiny_checkpoint(args.pop("path"), **args)
    print(path)


if __name__ == "__main__":
    main()
