"""The DeepSeek-V3 decoder (Kimi K2 and K2.6 too): multi-head latent attention, and a feed-forward that is
a SwiGLU in the first `first_k_dense_replace` layers and a mixture of experts in the rest."""
from __future__ import annotations

from torch import nn

from engine.core.spec import ModelSpec
from engine.model.architectures.base import DecoderLayer, DecoderModel
from engine.model.layers.mla import MLAttention
from engine.model.layers.mlp import SwiGLU
from engine.model.layers.moe import MoE
from engine.model.layers.mtp import MultiTokenPredictor


def feed_forward(config: ModelSpec, layer: int) -> nn.Module:
    if config.ffn.layer_kinds[layer] == "moe":
        return MoE(config.hidden_size, config.ffn)
    return SwiGLU(config.hidden_size, config.ffn.dense_intermediate)


class DeepseekV3Model(DecoderModel):
    def __init__(self, config: ModelSpec) -> None:
        super().__init__(config, [DecoderLayer(config, MLAttention(config, i), feed_forward(config, i))
                                  for i in range(config.num_layers)])
        self.mtp: MultiTokenPredictor | None = None

    def new_mtp(self) -> MultiTokenPredictor:
        """The model's MTP module (one): its block is a MoE layer where the model has experts, attending through
        the pool's layer after the main ones."""
        config = self.config
        ffn = MoE(config.hidden_size, config.ffn) if config.ffn.moe_layers else SwiGLU(
            config.hidden_size, config.ffn.dense_intermediate)
        return MultiTokenPredictor(config, DecoderLayer(config, MLAttention(config, config.num_layers), ffn))
