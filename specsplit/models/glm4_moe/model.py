"""The GLM-4.5 target: embedding, GQA + MLP-or-MoE decoder layers, final norm, LM head.

A `TargetModel` whose layers are `Glm4MoeDecoderLayer`s; the paged KV cache, the rotary tables (over
`rotary_dim` of each head) and the Triton attention path are the Llama family's. Parameter names equal
the checkpoint's.
"""

from __future__ import annotations

from torch import nn

from specsplit.models.glm4_moe.layers import Glm4MoeDecoderLayer
from specsplit.models.target import TargetModel


class Glm4MoeTarget(TargetModel):
    def _make_layer(self, index: int) -> nn.Module:
        return Glm4MoeDecoderLayer(self.config, index)
