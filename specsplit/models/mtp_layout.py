"""Where an MTP layer's tensors live in a checkpoint, and how its inputs are combined.

`MTPModule` parameter names are fixed (DeepSeek's vocabulary): `embed_tokens`, `enorm`, `hnorm`,
`eh_proj`, `block.<decoder layer>`, `shared_head.norm`, `shared_head.head`. A layout maps each of them
to the checkpoint names to try, first present wins.

DeepSeek-V3 layout (vLLM `model_executor/models/deepseek_mtp.py`, DeepSeek-V3 report §2.2):
    model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
    embed_tokens (optional copy of the shared one), <decoder layer>}
    input = eh_proj(cat([enorm(embed(x)), hnorm(h)])); logits = shared_head.head(shared_head.norm(out)).

MiMo layout, checked against XiaomiMiMo's `modeling_mimo.py` (class MiMoMTPLayers, repo
XiaomiMiMo/MiMo and the HF hub copy) and vLLM `model_executor/models/mimo_mtp.py`
(MiMoMultiTokenPredictorLayer + map_model_name_to_mtp_param_name):
    model.mtp_layers.{i}.token_layernorm   ↔ enorm
    model.mtp_layers.{i}.hidden_layernorm  ↔ hnorm
    model.mtp_layers.{i}.input_proj        ↔ eh_proj   (2H → H, no bias)
    model.mtp_layers.{i}.final_layernorm   ↔ shared_head.norm
    model.mtp_layers.{i}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*} ↔ block.*
    no head of its own: logits use the target's lm_head.
    Concat order is REVERSED: input_proj(cat([hidden_layernorm(h), token_layernorm(embed(x))])).
    final_layernorm is applied inside the layer's forward (vLLM returns the normed state, and its
    proposer feeds that normed state back for later draft steps); we do the same.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.models.config import ModelConfig


@dataclass(frozen=True)
class MTPLayout:
    name: str  # "deepseek" | "mimo"
    layer_prefix: str  # checkpoint prefix of MTP layer i, with {layer}
    renames: dict[str, str]  # MTPModule name → checkpoint name under the prefix (non-block tensors)
    hidden_first: bool  # concat order: [hnorm(h), enorm(e)] instead of [enorm(e), hnorm(h)]
    normed_output: bool  # forward already applies shared_head.norm (MiMo's final_layernorm)
    layer_stores_shared: bool  # the layer may store its own embed_tokens and shared_head.head

    def prefix(self, config: ModelConfig, layer: int = 0) -> str:
        """Checkpoint name prefix of MTP layer `layer` (DeepSeek numbers them after the target's)."""
        index = config.num_hidden_layers + layer if self.name == "deepseek" else layer
        return self.layer_prefix.format(layer=index)

    def checkpoint_candidates(self, config: ModelConfig, param_name: str, layer: int = 0) -> list[str]:
        """Checkpoint tensor names for one MTPModule parameter, most preferred first."""
        prefix = self.prefix(config, layer)
        shared_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        if param_name == "embed_tokens.weight":
            # Prefer the target's embedding; DeepSeek MTP layers may store an identical copy.
            return ["model.embed_tokens.weight"] + (
                [prefix + "embed_tokens.weight"] if self.layer_stores_shared else []
            )
        if param_name == "shared_head.head.weight":
            return ([prefix + "shared_head.head.weight"] if self.layer_stores_shared else []) + [shared_head]
        if param_name.startswith("block."):
            return [prefix + param_name.removeprefix("block.")]
        module, _, leaf = param_name.rpartition(".")
        if module not in self.renames:
            raise KeyError(f"no checkpoint name for MTP parameter {param_name!r} in layout {self.name!r}")
        return [f"{prefix}{self.renames[module]}.{leaf}"]


DEEPSEEK_LAYOUT = MTPLayout(
    name="deepseek",
    layer_prefix="model.layers.{layer}.",
    renames={
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "shared_head.norm": "shared_head.norm",
    },
    hidden_first=False,
    normed_output=False,
    layer_stores_shared=True,
)

MIMO_LAYOUT = MTPLayout(
    name="mimo",
    layer_prefix="model.mtp_layers.{layer}.",
    renames={
        "enorm": "token_layernorm",
        "hnorm": "hidden_layernorm",
        "eh_proj": "input_proj",
        "shared_head.norm": "final_layernorm",
    },
    hidden_first=True,
    normed_output=True,
    layer_stores_shared=False,
)


def mtp_layout(config: ModelConfig) -> MTPLayout:
    return MIMO_LAYOUT if config.architecture == "MiMoForCausalLM" else DEEPSEEK_LAYOUT
