"""Writes tiny, random, but complete DeepSeek-V3 checkpoints (config.json as DeepSeek ships it).

A few layers (the first `first_k_dense_replace` dense, the rest MoE), a few experts in a few groups,
MLA with small ranks, YaRN, and one MTP layer `model.layers.{num_hidden_layers}` with the DeepSeek
names (`enorm`, `hnorm`, `eh_proj`, `shared_head.*`, copies of the embedding and head, an MoE decoder
block). Experts are stored one by one (`mlp.experts.{e}.gate_proj.weight`, …) as in the published
checkpoints; transformers merges them on load. Plus generation_config.json and a byte-level tokenizer.

Weights use std 0.15 (not 0.02) so greedy decoding's top-2 logits and the router's expert scores are
well separated: our forward and transformers' agree to ~1e-6, and a tie at that scale would change
an expert choice or a greedy token.

    python -m models.deepseek_v3.tiny DIR [--seed N] [--num-hidden-layers N]
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import safetensors.torch
import torch

from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.model import DeepseekV3Target
from models.deepseek_v3.mtp import DeepseekV3MTP
from models.mtp_layout import DEEPSEEK_LAYOUT
from models.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, write_tiny_tokenizer

WEIGHT_STD = 0.15
# DeepSeek-V3's own rope_scaling, with the context lengths shrunk (factor 40 over 4096 there).
TINY_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def write_tiny_deepseek_checkpoint(
    path: str | pathlib.Path,
    *,
    seed: int = 0,
    vocab_size: int = 320,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    moe_intermediate_size: int = 32,
    num_hidden_layers: int = 3,
    first_k_dense_replace: int = 1,
    num_attention_heads: int = 4,
    q_lora_rank: int | None = 32,
    kv_lora_rank: int = 32,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 16,
    n_routed_experts: int = 8,
    n_group: int = 2,
    topk_group: int = 1,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    routed_scaling_factor: float = 2.5,
    rope_scaling: dict[str, Any] | None = TINY_YARN,
    rope_interleave: bool | None = None,  # None: key absent, as in DeepSeek's config (means True)
    num_nextn_predict_layers: int = 1,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    mtp_mimics_target: bool = False,
) -> pathlib.Path:
    """`mtp_mimics_target`: see `_mimic_target` (needs num_hidden_layers=1, first_k_dense_replace=0)."""
    if mtp_mimics_target and (num_hidden_layers != 1 or first_k_dense_replace != 0 or not num_nextn_predict_layers):
        raise ValueError("mtp_mimics_target needs num_hidden_layers=1, first_k_dense_replace=0 and an MTP layer")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_json = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "moe_intermediate_size": moe_intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "first_k_dense_replace": first_k_dense_replace,
        "moe_layer_freq": 1,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_attention_heads,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": n_routed_experts,
        "n_shared_experts": n_shared_experts,
        "n_group": n_group,
        "topk_group": topk_group,
        "num_experts_per_tok": num_experts_per_tok,
        "norm_topk_prob": True,
        "routed_scaling_factor": routed_scaling_factor,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "ep_size": 1,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "num_nextn_predict_layers": num_nextn_predict_layers,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
    }
    if rope_interleave is not None:
        config_json["rope_interleave"] = rope_interleave
    _write_json(path / "config.json", config_json)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID},
    )
    write_tiny_tokenizer(path, vocab_size, max_position_embeddings)
    config = DeepseekV3Config.from_pretrained(path)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        target = DeepseekV3Target(config)
    # named_parameters drops a tied lm_head, as transformers' save_pretrained does.
    tensors = {name: _random(tuple(p.shape), name, generator) for name, p in target.named_parameters()}
    if mtp_mimics_target:  # unit-RMS embeddings, so that enorm (weight 1) is the identity up to eps
        embed = tensors["model.embed_tokens.weight"]
        embed /= embed.pow(2).mean(-1, keepdim=True).sqrt()
    for layer in range(num_nextn_predict_layers):
        tensors.update(_mtp_tensors(config, layer, tensors, generator))
    if mtp_mimics_target:
        _mimic_target(config, tensors)
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _random(shape: tuple[int, ...], name: str, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):  # RMSNorm scales near 1, not exactly 1, so a wrong norm shows
        return 1.0 + 0.1 * noise
    if name.endswith((".bias", "e_score_correction_bias")):
        return 0.1 * noise
    return WEIGHT_STD * noise


def _mtp_tensors(
    config: DeepseekV3Config, layer: int, target: dict[str, torch.Tensor], generator: torch.Generator
) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        mtp = DeepseekV3MTP(config)
    prefix = DEEPSEEK_LAYOUT.prefix(config, layer)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in mtp.named_parameters():
        own = next(n for n in DEEPSEEK_LAYOUT.checkpoint_candidates(config, name, layer) if n.startswith(prefix))
        if name == "embed_tokens.weight":  # DeepSeek-V3 stores a copy of the shared embedding…
            tensors[own] = target["model.embed_tokens.weight"].clone()
        elif name == "shared_head.head.weight":  # …and of the LM head (of the embedding, when tied)
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            tensors[own] = target[head].clone()
        else:
            tensors[own] = _random(tuple(p.shape), own, generator)
    return tensors


def _mimic_target(config: DeepseekV3Config, tensors: dict[str, torch.Tensor]) -> None:
    """Makes MTP layer 0 repeat the one-layer target, so that most of its drafts are accepted.

    The block becomes a copy of target layer 0, eh_proj passes enorm(embed(x_{p+1})) through and
    ignores h_p, shared_head.norm is the final norm. Over pairs at positions 1..p+1 the MTP layer then
    computes the target's prediction of x_{p+2} from x_1..x_{p+1}: x_0 is all it lacks. Random MTP
    weights would have every draft rejected, and the accept paths of an end-to-end test untested.
    """
    prefix, hidden = DEEPSEEK_LAYOUT.prefix(config, 0), config.hidden_size
    for name in [n for n in tensors if n.startswith("model.layers.0.")]:
        tensors[prefix + name.removeprefix("model.layers.0.")] = tensors[name].clone()
    tensors[prefix + "enorm.weight"] = torch.ones(hidden)
    tensors[prefix + "hnorm.weight"] = torch.ones(hidden)
    tensors[prefix + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors[prefix + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()


def _write_json(file: pathlib.Path, obj: dict) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random DeepSeek-V3 checkpoint with an MTP layer.")
    parser.add_argument("path", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-hidden-layers", type=int, default=3)
    args = parser.parse_args(argv)
    print(write_tiny_deepseek_checkpoint(args.path, seed=args.seed, num_hidden_layers=args.num_hidden_layers))


if __name__ == "__main__":
    main()
