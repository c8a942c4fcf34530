"""The model configuration every other module in `models/` is built from.

`ModelConfig.from_pretrained(path)` reads a Hugging Face checkpoint directory (never the hub) and
normalises the differences between Llama, Qwen2, Qwen3 and MiMo into one flat, frozen record.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiMoForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The architecture of each model_type specsplit implements, for a config.json without `architectures`
# (`PretrainedConfig.save_pretrained` leaves it out for a config not taken from a model).
MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mimo": "MiMoForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}

# What transformers' configuration class of each model_type fills in for a key config.json leaves out, for every
# key specsplit reads (transformers 5). MiMo (Qwen2 + MTP layers, its "mimo" model_type known to transformers only
# through trust_remote_code, which we never use) reads as Qwen2. config.json is read here, not by transformers'
# AutoConfig: importing transformers and its config classes is a large part of a verifier's or drafter's start
# (docs/design.md, §8, rule 1). tests/models/test_config_json.py checks that every family reads as transformers
# reads it, key left out by key.
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "num_key_value_heads": None,  # None: one per attention head
    "head_dim": None,  # None: hidden_size // num_attention_heads
}
_QWEN_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
}
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 2048,
    },
    "qwen2": _QWEN_DEFAULTS,
    "mimo": _QWEN_DEFAULTS,
    "qwen3": {**_QWEN_DEFAULTS, "head_dim": 128},
    "deepseek_v3": {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "max_position_embeddings": 4096,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "rope_interleave": True,
    },
    "glm4_moe": {
        "vocab_size": 151552,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": False,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
    },
}
# RoPE types whose parameters carry the pretraining context length.
_LONG_CONTEXT_ROPE_TYPES = ("llama3", "yarn", "longrope")


class UnsupportedArchitectureError(ValueError):
    """config.json names no architecture specsplit implements."""


def read_config_json(path: pathlib.Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    return json.loads(config_file.read_text())


def checkpoint_architecture(path: pathlib.Path, raw: dict[str, Any], supported: Sequence[str]) -> str:
    """The first of config.json's `architectures` in `supported`; without `architectures`, the
    architecture of its `model_type`. `raw` is the config.json of checkpoint directory `path`."""
    listed = raw.get("architectures") or []
    model_type = raw.get("model_type")
    candidates = listed or [MODEL_TYPE_ARCHITECTURES.get(model_type, "")]
    architecture = next((a for a in candidates if a in supported), None)
    if architecture is None:
        if listed:
            named = f"architecture{'s' * (len(listed) > 1)} {', '.join(map(repr, listed))}"
        else:
            named = f"model_type {model_type!r} (no architectures listed)"
        raise UnsupportedArchitectureError(
            f"unsupported {named} in {str(path / 'config.json')!r}; supported: {', '.join(supported)}"
        )
    return architecture


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama", "qwen2", "qwen3", "mimo"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else the scaling parameters with "rope_type" ("linear" | "llama3").
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q_proj, k_proj, v_proj (Qwen2 always; Llama/Qwen3 when configured)
    o_proj_bias: bool  # bias on o_proj (Llama/Qwen3 `attention_bias` covers it, Qwen2 never has it)
    mlp_bias: bool  # bias on gate/up/down (Llama `mlp_bias`)
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    num_nextn_predict_layers: int  # MTP layers shipped in the checkpoint (0 = none)
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in
    partial_rotary_factor: float = 1.0  # the share of each head RoPE rotates (GLM-4.5: 0.5)

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates the first `rotary_dim` of each head's `head_dim` values (transformers' rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, hf: Any = None) -> ModelConfig:
        """Reads `config.json` (+ `generation_config.json`) of a local checkpoint directory. `hf`: its fields as
        a transformers configuration object holds them, `read_hf_config`'s when not given."""
        path = pathlib.Path(path)
        raw = read_config_json(path)
        architecture = checkpoint_architecture(path, raw, SUPPORTED_ARCHITECTURES)
        model_type = architecture_model_type(raw, architecture)
        hf = hf if hf is not None else read_hf_config(raw, model_type)
        return _from_hf_config(hf, architecture, model_type, raw, _read_eos_token_ids(path, raw))


def architecture_model_type(raw: dict[str, Any], architecture: str) -> str:
    """config.json's `model_type`, or the one of its architecture where it names none; always "mimo" for MiMo (its
    config.json may name Qwen2's, whose layers it has)."""
    if architecture == "MiMoForCausalLM":
        return "mimo"
    return raw.get("model_type") or {a: t for t, a in MODEL_TYPE_ARCHITECTURES.items()}[architecture]


def read_hf_config(raw: dict[str, Any], model_type: str) -> SimpleNamespace:
    """config.json's fields as transformers' configuration class of `model_type` holds them: its defaults for the
    keys left out (`CONFIG_DEFAULTS`), and (as transformers 5 has them) the RoPE parameters gathered in
    `rope_parameters` with the theta, the partial rotary factor, the type and, for a long-context type, the
    pretraining context length."""
    values = {**_COMMON_DEFAULTS, **CONFIG_DEFAULTS.get(model_type, {}), **raw}
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope.setdefault("rope_theta", values["rope_theta"])
    if values.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", values["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in _LONG_CONTEXT_ROPE_TYPES:
        rope.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    values["rope_parameters"], values["model_type"] = rope, model_type
    return SimpleNamespace(**values)


def _from_hf_config(
    hf: Any, architecture: str, model_type: str, raw: dict[str, Any], eos_token_ids: list[int]
) -> ModelConfig:
    hidden_act = getattr(hf, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r} (only 'silu' is implemented)")
    if getattr(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    rope_theta, rope_scaling = rope_parameters(hf, SUPPORTED_ROPE_TYPES)
    is_qwen2 = architecture in ("Qwen2ForCausalLM", "MiMoForCausalLM")
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", getattr(hf, "tie_word_embeddings", False))),
        attention_bias=True if is_qwen2 else attention_bias,
        o_proj_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        eos_token_ids=eos_token_ids,
        torch_dtype=_dtype_name(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
    )


def rope_parameters(
    hf: Any, supported: tuple[str, ...], partial_rotary: bool = False
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or 4.x fields, for the rope
    types in `supported`; fills the defaults transformers derives (llama3's original context, YaRN's
    factor when only the context lengths are given). A `partial_rotary_factor` other than 1 is refused
    unless `partial_rotary` (the family reads it with `partial_rotary_factor`)."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in supported:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(supported)}")
    if params.pop("partial_rotary_factor", 1.0) != 1.0 and not partial_rotary:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", hf.max_position_embeddings)
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = hf.max_position_embeddings / params["original_max_position_embeddings"]
    return float(theta), {"rope_type": rope_type, **params}


def partial_rotary_factor(hf: Any) -> float:
    """transformers 5 keeps it in `rope_parameters`, 4.x as a top-level field."""
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0)


def _read_eos_token_ids(path: pathlib.Path, raw: dict[str, Any]) -> list[int]:
    """EOS ids as `generate` uses them: generation_config.json first, config.json otherwise."""
    eos = None
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")
