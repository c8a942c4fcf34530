"""DeepSeek-V3 (and R1, V3.1: the same architecture) configuration, read from a checkpoint directory.

One flat, frozen record like `specsplit.models.config.ModelConfig`, with the fields of multi-head latent
attention (MLA), the DeepSeek MoE and YaRN. The fields the services read (`architecture`,
`vocab_size`, `hidden_size`, `max_position_embeddings`, `eos_token_ids`, `has_mtp`, ...) have the
same names and meaning as in `ModelConfig`.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

from specsplit.models.config import (
    _dtype_name,
    _read_eos_token_ids,
    architecture_model_type,
    checkpoint_architecture,
    read_config_json,
    read_hf_config,
    rope_parameters,
)

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class DeepseekV3Config:
    architecture: str  # "DeepseekV3ForCausalLM"
    model_type: str  # "deepseek_v3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP of the first `first_k_dense_replace` layers
    num_hidden_layers: int
    num_attention_heads: int
    # MLA: queries through a rank-`q_lora_rank` bottleneck (None: one q_proj, as in V2-Lite); keys and
    # values from one latent of `kv_lora_rank` plus a shared RoPE key of `qk_rope_head_dim`.
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
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
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else the scaling parameters with "rope_type" ("linear" | "yarn").
    rope_scaling: dict[str, Any] | None
    rope_interleave: bool  # RoPE on interleaved pairs (x0, x1), (x2, x3), … as DeepSeek ships it
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q_a_proj, kv_a_proj_with_mqa and o_proj
    num_nextn_predict_layers: int
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "bfloat16"

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The rotary dimension (transformers calls it head_dim in DeepSeek-V3's config too)."""
        return self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        """What `specsplit.models.rotary` computes frequencies for: only the RoPE part of each head."""
        return self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Cached values per token and layer: the latent and the RoPE key, nothing per head."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Layer index as in the checkpoint; the MTP layers (index >= num_hidden_layers) are MoE too."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, hf: Any = None) -> DeepseekV3Config:
        """`hf`: config.json's fields as a transformers configuration object holds them, `read_hf_config`'s
        when not given."""
        path = pathlib.Path(path)
        raw = read_config_json(path)
        architecture = checkpoint_architecture(path, raw, ARCHITECTURES)
        _check_supported(raw)
        hf = hf if hf is not None else read_hf_config(raw, architecture_model_type(raw, architecture))
        rope_theta, rope_scaling = rope_parameters(hf, SUPPORTED_ROPE_TYPES)
        return cls(
            architecture=architecture,
            model_type=hf.model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            q_lora_rank=hf.q_lora_rank,
            kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            v_head_dim=hf.v_head_dim,
            moe_intermediate_size=hf.moe_intermediate_size,
            n_routed_experts=hf.n_routed_experts,
            n_shared_experts=hf.n_shared_experts or 0,
            num_experts_per_tok=hf.num_experts_per_tok,
            n_group=hf.n_group or 1,
            topk_group=hf.topk_group or 1,
            norm_topk_prob=bool(hf.norm_topk_prob),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            first_k_dense_replace=hf.first_k_dense_replace or 0,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rope_interleave=bool(getattr(hf, "rope_interleave", True)),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            eos_token_ids=_read_eos_token_ids(path, raw),
            torch_dtype=_dtype_name(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        )


def _check_supported(raw: dict[str, Any]) -> None:
    """Reject the DeepSeek variants this code does not implement, rather than computing garbage."""
    unsupported = {
        "hidden_act": (raw.get("hidden_act", "silu"), ("silu",)),
        "scoring_func": (raw.get("scoring_func", "sigmoid"), ("sigmoid",)),  # V2: softmax
        "topk_method": (raw.get("topk_method", "noaux_tc"), ("noaux_tc",)),  # V2: greedy / group_limited
        "moe_layer_freq": (raw.get("moe_layer_freq", 1), (1,)),
    }
    for key, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"unsupported {key}={value!r} for DeepSeek-V3; supported: {list(allowed)}")
    experts, groups = raw.get("n_routed_experts"), raw.get("n_group") or 1
    if experts is None or experts % groups or experts // groups < 2:
        raise ValueError(f"n_routed_experts={experts} must split into n_group={groups} groups of >= 2 experts")
