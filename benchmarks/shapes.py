"""Model shapes for benchmarks with random weights (`--load-format dummy`): a checkpoint directory
holding only config.json, generation_config.json and a tokenizer.

    python benchmarks/shapes.py qwen2-7b /tmp/qwen2-7b

qwen2-7b is Qwen2-7B's layout (hidden 3584, 28 layers, 28 heads / 4 KV heads of 128, MLP 18944,
vocabulary 152064, untied head) plus one MTP layer in the DeepSeek-V3 layout of the same width
(`model.layers.28.*`). glm-4.5-air is GLM-4.5-Air's (zai-org/GLM-4.5-Air config.json: hidden 4096, 46
layers, 96 heads / 8 KV heads of 128 with q/k/v bias and RoPE on half of each head, a dense first
layer of 10944, then 128 routed experts of 1408 (8 per token, one group) and one shared, vocabulary
151552) with its MTP layer `model.layers.46.*`: about 110B parameters, 220 GB in bf16, so it fits one
H200 only once its weights are FP8. The -tiny shapes are the same architectures, small enough for a CPU
smoke run. The tokenizer is the demo checkpoint's: the coordinator needs one to
detokenize. Its vocabulary (4096) is smaller than the model's; that is harmless because benchmarks
send token ids (validated against the model's vocabulary) and the detokenizer skips ids it does not
know, so text is incomplete but ids, speed and losslessness are what is measured.

qwen2-7b-fp8 and glm-4.5-air-fp8 are those with DeepSeek-V3's block-scaled FP8 quantization_config:
the dummy weights are quantized to e4m3 with [128, 128] block scales as they are drawn (one linear at a
time, so GLM-4.5-Air's ~110 GB of FP8 weights load on one H200) and the linears run the W8A8 kernel.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "checkpoints" / "demo"

# config.json keys of every shape of an architecture; a shape not in FAMILY is a Qwen2.
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "rms_norm_eps": 1e-6,
    "use_sliding_window": False,
}
GLM4_MOE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
}
FAMILY = {"glm-4.5-air": GLM4_MOE, "glm-tiny": GLM4_MOE}

SHAPES = {
    "qwen2-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
    # Qwen2-72B's layout: a target that needs tensor parallelism (145 GB of bf16 weights; benchmarks/tp_step.py).
    "qwen2-72b": dict(
        hidden_size=8192,
        intermediate_size=29568,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
    ),
    # The same architecture, small enough for a CPU smoke run of the benchmark.
    "qwen2-tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
    ),
    "glm-4.5-air": dict(
        hidden_size=4096,
        intermediate_size=10944,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=False,
        first_k_dense_replace=1,
        moe_intermediate_size=1408,
        n_routed_experts=128,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        vocab_size=151552,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
    ),
    "glm-tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=False,
        first_k_dense_replace=1,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
    ),
}

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
for _name in ("qwen2-7b", "glm-4.5-air"):
    SHAPES[f"{_name}-fp8"] = dict(SHAPES[_name], quantization_config=FP8)
FAMILY["glm-4.5-air-fp8"] = GLM4_MOE


def write_shape(name: str, path: str | Path) -> Path:
    """Writes the config directory of shape `name` at `path` (created) and returns it."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos = SHAPES[name]["vocab_size"] - 1
    config = {
        **FAMILY.get(name, QWEN2),
        **SHAPES[name],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}) + "\n")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / file, path / file)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path", type=Path)
    args = p.parse_args()
    print(write_shape(args.shape, args.path))


if __name__ == "__main__":
    main()
