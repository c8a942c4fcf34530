"""DeepSeek-V3 / R1: multi-head latent attention, DeepSeek MoE, YaRN, and its MTP layer."""

from specsplit.models.deepseek_v3.config import DeepseekV3Config
from specsplit.models.deepseek_v3.latent_cache import LatentKVCache
from specsplit.models.deepseek_v3.model import DeepseekV3Target
from specsplit.models.deepseek_v3.mtp import DeepseekV3MTP

__all__ = ["DeepseekV3Config", "DeepseekV3MTP", "DeepseekV3Target", "LatentKVCache"]
