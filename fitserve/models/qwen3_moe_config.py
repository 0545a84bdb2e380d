"""Qwen3-MoE's config rules that need no model code (the planner reads them before anything is built):
the model type, and the refusal of a format that would quantize the sparse layers' experts in a form they
do not run (models/moe_experts_format.py holds the rule, shared with Qwen3.5's MoE)."""

from __future__ import annotations

from typing import Any

from fitserve.layers.quantization.layer_projections import moe_sparse_layer
from fitserve.models.moe_experts_format import refuse_quantized_experts as refuse_experts

QWEN3_MOE_MODEL_TYPES = ("qwen3_moe",)


def is_qwen3_moe(config: Any) -> bool:
    return str(getattr(config, "model_type", "")) in QWEN3_MOE_MODEL_TYPES


def refuse_quantized_experts(config: Any, fmt: Any) -> None:
    """ValueError when the checkpoint's format `fmt` (or --quantization) would quantize the sparse layers'
    experts in a form they do not run (models/moe_experts_format.py); a format whose ignore list names them
    leaves them 16-bit."""
    sparse = [i for i in range(int(config.num_hidden_layers)) if moe_sparse_layer(config, i)]
    refuse_experts(config, fmt, "Qwen3-MoE model", sparse)
