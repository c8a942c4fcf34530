"""GLM-4.5 (and 4.5-Air, 4.6: the same architecture) configuration, read from a checkpoint directory.

A `ModelConfig` (the GQA attention, norms and RoPE are the Llama family's, with a `partial_rotary_factor`,
q/k norm where `use_qk_norm` says so and no o_proj bias) plus the fields of DeepSeek-V3's MoE
(`specsplit.models.moe`), which GLM-4.5 uses unchanged, and `first_k_dense_replace` dense layers first.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

from specsplit.models.config import (
    ModelConfig,
    _dtype_name,
    _read_eos_token_ids,
    architecture_model_type,
    checkpoint_architecture,
    partial_rotary_factor,
    read_config_json,
    read_hf_config,
    rope_parameters,
)

ARCHITECTURES = ("Glm4MoeForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default",)  # GLM-4.5 ships rope_scaling null


@dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(ModelConfig):
    # MoE: sigmoid gating with a score-correction bias, top-`topk_group` of `n_group` groups, then
    # top-`num_experts_per_tok` experts; weights (optionally renormalised) × routed_scaling_factor.
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int  # layers below it have the dense MLP of `intermediate_size`

    def is_moe_layer(self, layer: int) -> bool:
        """Layer index as in the checkpoint; the MTP layers (index >= num_hidden_layers) are MoE too."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, hf: Any = None) -> Glm4MoeConfig:
        """`hf`: config.json's fields as a transformers configuration object holds them, `read_hf_config`'s
        when not given."""
        path = pathlib.Path(path)
        raw = read_config_json(path)
        architecture = checkpoint_architecture(path, raw, ARCHITECTURES)
        _check_supported(raw)
        hf = hf if hf is not None else read_hf_config(raw, architecture_model_type(raw, architecture))
        rope_theta, rope_scaling = rope_parameters(hf, SUPPORTED_ROPE_TYPES, partial_rotary=True)
        num_heads = hf.num_attention_heads
        num_kv_heads = hf.num_key_value_heads or num_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        config = cls(
            architecture=architecture,
            model_type=hf.model_type,
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
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),  # q, k and v only
            o_proj_bias=False,
            mlp_bias=False,
            qk_norm=bool(getattr(hf, "use_qk_norm", False)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            eos_token_ids=_read_eos_token_ids(path, raw),
            torch_dtype=_dtype_name(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            partial_rotary_factor=partial_rotary_factor(hf),
            moe_intermediate_size=hf.moe_intermediate_size,
            n_routed_experts=hf.n_routed_experts,
            n_shared_experts=hf.n_shared_experts or 0,
            num_experts_per_tok=hf.num_experts_per_tok,
            n_group=hf.n_group or 1,
            topk_group=hf.topk_group or 1,
            norm_topk_prob=bool(hf.norm_topk_prob),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            first_k_dense_replace=hf.first_k_dense_replace or 0,
        )
        if config.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={config.partial_rotary_factor} of head_dim={head_dim} leaves an odd "
                f"rotary dimension ({config.rotary_dim})"
            )
        return config


def _check_supported(raw: dict[str, Any]) -> None:
    """Reject what this code does not implement, rather than computing garbage."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r} (only 'silu' is implemented)")
    experts, groups = raw.get("n_routed_experts"), raw.get("n_group") or 1
    if experts is None or experts % groups or experts // groups < 2:
        raise ValueError(f"n_routed_experts={experts} must split into n_group={groups} groups of >= 2 experts")
