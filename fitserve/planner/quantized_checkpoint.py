"""An int4 checkpoint checked before anything loads: its format is one fitserve runs, `--quantization`
(when given) names it, and its group size fits every quantized layer (layers/quantization/quant_config.py
holds the rules and the messages)."""

from __future__ import annotations

import logging

from fitserve.layers.quantization.quant_config import Int4Format, check_layer_shapes, int4_format
from fitserve.planner.bnb_headers import check_bnb_checkpoint
from fitserve.planner.model_info import ModelInfo

logger = logging.getLogger("fitserve")


def check_quantized_checkpoint(model: ModelInfo, quantization: str | None) -> Int4Format | None:
    """The checkpoint's int4 format (None when not quantized); ValueError naming the value, the limit and
    the fix for a format, an option or a shape fitserve does not run."""
    fmt = int4_format(model.hf_config, quantization)
    if fmt is None:
        return None
    check_layer_shapes(fmt, model.hf_config)
    if getattr(fmt, "prequantized", False) and model.resolved is not None and model.weights.file_bytes:
        check_bnb_checkpoint(fmt, model.resolved.model_path, model.hf_config)  # bitsandbytes: its headers
    logger.info("Quantized checkpoint: %s", fmt.describe())
    return fmt
