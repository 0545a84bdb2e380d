"""A Qwen3.5 / Qwen3.6 decoder layer: its token mixer (Gated DeltaNet, models/qwen3_5_delta_net.py, or full
attention, models/qwen3_5_layers.py, by config.layer_types) and its MLP or MoE block, each after an RMSNorm,
with the residual stream added after each (on CUDA the add and the next norm in one kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitserve.models.qwen3_5_config import LINEAR_ATTENTION
from fitserve.models.qwen3_5_delta_net import GatedDeltaNet
from fitserve.models.qwen3_5_layers import (
    PartialRope,
    Qwen3_5Attention,
    Qwen3_5MLP,
    Qwen3_5RMSNorm,
    Qwen3_5SparseMoeBlock,
    check_activation,
    linear_method_of,
)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, quant: Any = None) -> None:
        """quant: the checkpoint's quantized format (layers/quantization/quant_config.quant_format) or
        None (a MoE layer's experts take it when they run it: models/qwen3_5_config.refuse_quantized_moe)."""
        super().__init__()
        check_activation(str(getattr(config, "hidden_act", "silu")))
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx, quant)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx, quant)
        if getattr(config, "num_experts", None):
            self.mlp: nn.Module = Qwen3_5SparseMoeBlock(config, layer_idx, quant)
        else:
            self.mlp = Qwen3_5MLP(
                hidden,
                int(config.intermediate_size),
                linear_method_of(quant, config, layer_idx, "mlp", "gate_up_proj", ("gate_proj", "up_proj")),
                linear_method_of(quant, config, layer_idx, "mlp", "down_proj", ("down_proj",)),
            )
        self.input_layernorm = Qwen3_5RMSNorm(hidden, eps)
        self.post_attention_layernorm = Qwen3_5RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, rope: PartialRope) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        mixed = self.linear_attn(normed) if self.is_linear else self.self_attn(normed, rope)
        normed, hidden = self.post_attention_layernorm.add_and_norm(mixed, hidden)
        return hidden + self.mlp(normed)
