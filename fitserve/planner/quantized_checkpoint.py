"""An int4 checkpoint checked before anything loads: its format is one fitserve runs, `--quantization`
(when given) names it, and its group size fits every quantized layer (layers/quantization/quant_config.py
holds the rules and the messages)."""

from __future__ import annotations

import logging
from typing import Any

from fitserve.layers.quantization.layer_projections import is_gemma4
from fitserve.layers.quantization.quant_config import Int4Format, check_layer_shapes, int4_format
from fitserve.models.gemma4_config import refuse_quantized_experts
from fitserve.models.qwen3_5_config import refuse_quantized_moe
from fitserve.models.qwen3_moe_config import is_qwen3_moe
from fitserve.models.qwen3_moe_config import refuse_quantized_experts as refuse_qwen3_moe_experts
from fitserve.planner.bnb_headers import check_bnb_checkpoint
from fitserve.planner.model_info import ModelInfo

logger = logging.getLogger("fitserve")


def refuse_quantized_moe_experts(hf_config: Any, fmt: Any) -> None:
    """ValueError (naming the format, the model and what runs) when `fmt` would quantize a MoE model's
    experts in a form they do not run (models/moe_experts_format.py: 16-bit, int4 without act order or an
    FP8 checkpoint's); nothing for a dense model or experts that run."""
    if is_gemma4(hf_config):
        refuse_quantized_experts(hf_config, fmt)
    elif is_qwen3_moe(hf_config):
        refuse_qwen3_moe_experts(hf_config, fmt)
    else:
        refuse_quantized_moe(hf_config, fmt)  # Qwen3.5 / Qwen3.6 MoE


def check_quantized_checkpoint(model: ModelInfo, quantization: str | None) -> Int4Format | None:
    """The checkpoint's int4 format (None when not quantized); ValueError naming the value, the limit and
    the fix for a format, an option or a shape fitserve does not run."""
    fmt = int4_format(model.hf_config, quantization)
    if fmt is None:
        return None
    refuse_quantized_moe_experts(model.hf_config, fmt)
    check_layer_shapes(fmt, model.hf_config)
    if getattr(fmt, "prequantized", False) and model.resolved is not None and model.weights.file_bytes:
        check_bnb_checkpoint(fmt, model.resolved.model_path, model.hf_config)  # bitsandbytes: its headers
    logger.info("Quantized checkpoint: %s", fmt.describe())
    return fmt
