"""Model shapes for benchmarks with random weights (`--load-format dummy`): a checkpoint directory
holding only config.json, generation_config.json and a tokenizer.

    python -m benchmarks.lib.shapes qwen2-7b /tmp/qwen2-7b

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

qwen2-7b-fp8, glm-4.5-air-fp8 and deepseek-v3-fp8 (and the tiny ones) are those with DeepSeek-V3's
block-scaled FP8 quantization_config: the dummy weights are quantized to e4m3 with [128, 128] block scales
as they are drawn (one linear at a time, so ~110 GB of FP8 weights load on one H200) and the linears run
the W8A8 kernel.

One H200 (139.8 GiB = 150.1 GB as torch reports it; bytes from `benchmarks/lib/weight_bytes.py`, tested in
tests/benchmarks/test_weight_bytes.py). `specsplit up` gives the services 0.9 of the device: a co-located
drafter 0.1 (13.9 GiB after the 1/200 headroom), the verifier 0.8 (111.3 GiB). Each needs its weights, the
fp32 logits of its largest step (512 rows, the servers' token budget) plus 3.5 GiB of workspace (measured on the
H200: `weight_bytes.WORKSPACE_BYTES`), and a KV cache: the verifier's for batch 32 (32 x (64 + 32 + 4) = 3200
tokens; more than its --max-model-len 1024 in `benchmarks/e2e.py --services-only`), the drafter's for one request
of the model's context length (it has no --max-model-len). Decoder linears are FP8 (1 byte + an fp32 scale per
128 x 128 block), embedding, LM heads and eh_proj bf16, routers fp32; the drafter holds an embedding and LM head
of its own.

    glm-4.5-air-fp8   attention 109 MB/layer; dense layer 0: + 134 MB; MoE layer: 129 experts x 3 x 4096 x
                      1408 = 2.23 GB + attention = 2.34 GB; embedding + head 2 x 1.24 GB
                      verifier 2.48 + 0.24 + 45 x 2.34 = 108.2 GB, with logits, workspace and KV 105.1 GiB
                      of 111.3: fits at up's 0.8 / 0.1 (drafter 4.9 GB, needs 8.8 of 13.9 GiB)
    deepseek-v3-fp8   MLA 170 MB FP8 + kv_b_proj 34 MB bf16 (dequantized at load) = 204 MB/layer; dense
                      layers 0-2: + 396 MB = 0.60 GB; MoE layer: 257 experts x 3 x 7168 x 2048 = 11.32 GB +
                      router + MLA = 11.53 GB; embedding + head 2 x 1.85 GB
                      drafter (MTP layer 11.53 + eh_proj 0.21 + 3.71) = 15.44 GB, needs 18.3 GiB: more than
                      up's 0.1, so `e2e.py --services-only` gives it 0.14 (19.5 GiB) and the verifier 0.76
                      (105.7 GiB); verifier 3.71 + 3 x 0.60 + n x 11.53 GB with its workspace and KV
                      (3200 x 13.5 KB of latent cache): n = 9 MoE layers (105.6 GiB), 10 would need 116.3 GiB.
                      12 layers of the 61.

One H100 (about 78 GiB): the same arithmetic (`plan_shares`, tests/benchmarks/test_weight_bytes.py) holds
deepseek-v3-fp8-h100, 6 layers (3 dense + 3 MoE; the drafter 0.25 of the device, the verifier 0.65), and
glm-4.5-air-fp8-h100, 25 layers (1 dense + 24 MoE; 0.12 and 0.78). An H200 runs them too, so one command per shape
measures either GPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "rms_norm_eps": 1e-6,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "attention_bias": False,
}
FAMILY = {"glm-4.5-air": GLM4_MOE, "glm-tiny": GLM4_MOE, "deepseek-v3": DEEPSEEK_V3, "deepseek-v3-tiny": DEEPSEEK_V3}

DEEPSEEK_V3_H200_LAYERS = 12  # 3 dense + 9 MoE: the module docstring's arithmetic
DEEPSEEK_V3_H100_LAYERS = 6  # 3 dense + 3 MoE
GLM_45_AIR_H100_LAYERS = 25  # 1 dense + 24 MoE

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
    # Qwen2-72B's layout: a target that needs tensor parallelism (145 GB of bf16 weights; benchmarks/step.py --tp).
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
    # DeepSeek-V3's layout (deepseek-ai/DeepSeek-V3 config.json) at full width: MLA (128 heads, q through a 1536
    # rank, a 512 + 64 latent), 3 dense layers of 18432, then 256 routed experts of 2048 (8 per token, in the best
    # 4 of 8 groups) and one shared, vocabulary 129280; 61 layers in the checkpoint, cut here to what fits one H200
    # in FP8 (the module docstring).
    "deepseek-v3": dict(
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=DEEPSEEK_V3_H200_LAYERS,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense_replace=3,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        vocab_size=129280,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    # The same architecture cut in depth and width for a CPU smoke run (a dense layer, then MoE layers).
    "deepseek-v3-tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=1,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        vocab_size=8192,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
for _name in ("qwen2-7b", "glm-4.5-air", "glm-tiny", "deepseek-v3", "deepseek-v3-tiny"):
    SHAPES[f"{_name}-fp8"] = dict(SHAPES[_name], quantization_config=FP8)
    FAMILY[f"{_name}-fp8"] = FAMILY.get(_name, QWEN2)
# The FP8 MoE shapes cut to what one H100 holds (the module docstring).
for _name, _layers in (("deepseek-v3", DEEPSEEK_V3_H100_LAYERS), ("glm-4.5-air", GLM_45_AIR_H100_LAYERS)):
    SHAPES[f"{_name}-fp8-h100"] = dict(SHAPES[f"{_name}-fp8"], num_hidden_layers=_layers)
    FAMILY[f"{_name}-fp8-h100"] = FAMILY[_name]


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
