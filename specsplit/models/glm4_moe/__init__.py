"""GLM-4.5 / 4.5-Air / 4.6 (`Glm4MoeForCausalLM`): GQA attention with partial rotary, DeepSeek-V3's MoE,
and an MTP layer in DeepSeek-V3's layout."""

from specsplit.models.glm4_moe.config import Glm4MoeConfig
from specsplit.models.glm4_moe.model import Glm4MoeTarget
from specsplit.models.glm4_moe.mtp import Glm4MoeMTP

__all__ = ["Glm4MoeConfig", "Glm4MoeMTP", "Glm4MoeTarget"]
